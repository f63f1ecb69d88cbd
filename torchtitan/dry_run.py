"""``COMM_MODE=fake_backend``: validate a large job on one CPU process before launching it.

One process plays one rank (``RANK``) of a ``WORLD_SIZE``-rank job on a fake process group
(collectives return at once and move no data). The real config, mesh, model build and
parallelization run; then this module prints the rank's memory estimate and runs
``--comm.dry_run_steps`` steps: with real tensors when the step is small enough for this host,
otherwise on fake tensors, which carry shapes but no data. Values (loss, norms) mean nothing.
"""

import dataclasses
import os
import re

import torch

from torchtitan.batch_runner import BatchRunner
from torchtitan.components import lora
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config import JobConfig
from torchtitan.config.errors import ConfigError
from torchtitan.distributed import ParallelDims, pipeline_split, pipeline_timeline
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.spec import get_model_spec
from torchtitan.tools import memory_estimate
from torchtitan.tools.logging import logger
from torchtitan.tools.versions import torch_version
from torchtitan.trainer import Trainer

REAL_STEP_FLOPS = 1e12
"""Above this many FLOPs per rank and step, ``--comm.fake_compute auto`` steps on fake tensors:
a CPU core does a few tens of GFLOP/s, so one real step would take minutes."""


COMPILED_NOTE = (
    "The estimate follows eager execution (against one H100's allocator peak: +0.2% and +6% "
    "for Llama 3 8B_4layers and 1B); with --compile.enable the step's peak measured 22-41% "
    "lower there (fused kernels keep fewer temporaries), so read it as an upper bound"
)
"""docs/performance.md, "Memory estimate against the GPU allocator", has the figures."""


def wants_fake_compute(config: JobConfig) -> bool:
    """Whether the dry run should step on fake tensors (``--comm.fake_compute``)."""
    if config.comm.fake_compute != "auto":
        return config.comm.fake_compute == "fake"
    t = config.training
    spec = get_model_spec(config.model.name)
    dims = ParallelDims.from_config(config.parallelism, int(os.environ.get("WORLD_SIZE", "1")))
    accumulation = dims.grad_accum_steps(t.local_batch_size, t.global_batch_size)
    tokens = t.local_batch_size * t.seq_len * accumulation
    args = spec.args_for(config.model.flavor, seq_len=t.seq_len, config=config)
    flops = spec.flops_per_token(args, t.seq_len) * tokens / dims.non_data_parallel_size
    return flops > REAL_STEP_FLOPS


def build_trainer(config: JobConfig) -> Trainer:
    """The trainer of a dry run: no checkpointing (no real values to save or load), and the
    model left on the meta device when a real step would be too large for this host."""
    c = config.checkpoint
    if c.enable or c.create_seed_checkpoint:
        logger.warning("Checkpointing is off under COMM_MODE=fake_backend (no real values)")
        off = dataclasses.replace(c, enable=False, create_seed_checkpoint=False)
        config = dataclasses.replace(config, checkpoint=off)
    # Pipeline stages exchange metadata before their first step, which the fake process group
    # cannot carry: a pipelined dry run builds, places and counts, but does not step.
    pipelined = config.parallelism.pipeline_parallel_degree > 1
    return Trainer(config, on_meta=pipelined or wants_fake_compute(config))


def banner(trainer: Trainer) -> str:
    dims = trainer.parallel_dims
    compute = "fake tensors (shapes only)" if trainer.on_meta else "real tensors"
    return (
        f"DRY RUN (COMM_MODE=fake_backend): rank {trainer.rank} of {dims.world_size} simulated "
        f"ranks, no-op collectives, steps on {compute}. Losses, norms and other data-dependent "
        "values are meaningless; shapes, placements, memory and the config are what it checks."
    )


def estimate_memory(trainer: Trainer) -> memory_estimate.MemoryEstimate:
    """This rank's memory: exact state bytes from the built model, peak from shallow copies:
    the largest of the extrapolated step peak, the end of forward, and the end of backward
    (parameters, every gradient and the optimizer state at once: where a model whose weights
    outweigh its activations peaks, Qwen3 30B-A3B under EP; the probes peak at the loss, before
    any gradient)."""
    n_layers = trainer.model_args.n_layers
    one, two = _probe_step(trainer, 1), _probe_step(trainer, 2)
    parameters = [p for part in trainer.model_parts for p in part.parameters()]
    params = memory_estimate.local_bytes(parameters)
    grads = memory_estimate.local_bytes(p for p in parameters if p.requires_grad)
    # The probes' optimizer state, extrapolated, then scaled by how far their extrapolated
    # gradients are from the exact ones: exact for AdamW (2 moments per trainable byte) and
    # for models of identical blocks (also under Muon, whose states differ by parameter).
    # Under Muon with blocks unlike the probes' (1 state for the blocks' matrices, 2 for the
    # rest) scaling can fall short; the 2-block probe's ratio, where the non-block parameters
    # weigh more than in the model, cannot: the larger of the two is kept.
    state = memory_estimate.extrapolate(one["state"], two["state"], n_layers)
    scaled = state["Optstate"] * grads / max(state["Gradient"], 1)
    by_probe = two["state"]["Optstate"] * grads / max(two["state"]["Gradient"], 1)
    optimizer = round(max(scaled, by_probe))
    # Semi-synchronous training holds the synced weights beside the model (and DiLoCo the
    # outer momentum), in the parameters' dtype: counted with the optimizer's state.
    optimizer += grads * {"none": 0, "local_sgd": 1, "diloco": 2}[trainer.config.semi_sync.method]
    exact = {"Parameter": params, "Optstate": optimizer}
    forward, stepped = (
        memory_estimate.with_exact_state(moment, one["state"], two["state"], exact, n_layers)
        for moment in (
            memory_estimate.extrapolate(one["forward"], two["forward"], n_layers),
            memory_estimate.extrapolate_peak(one, two, n_layers),
        )
    )
    held = {"Parameter": params, "Gradient": grads, "Optstate": optimizer}
    held["Buffer"] = forward.get("Buffer", 0)
    peak = max(
        forward,
        stepped,
        held | {"Total": sum(held.values())},
        key=lambda categories: categories["Total"],
    )
    return memory_estimate.MemoryEstimate(
        n_layers=n_layers, parameters=params, gradients=grads, optimizer=optimizer, peak=peak
    )


def _probe_step(trainer: Trainer, depth: int | None) -> dict[str, dict[str, int]]:
    """Build the model with ``depth`` blocks (all of them for ``None``), parallelized like the
    real one, and measure a step on fake tensors. Returns the bytes by category at the peak
    and at the end of forward (``memory_estimate.peak_by_category``), and as ``"state"`` what
    the copy holds all step long: its ``Parameter`` bytes, trainable ones (``Gradient``) and
    optimizer state (``Optstate``).

    Under pipeline parallelism the probe is one micro-batch through the whole shallow model,
    unsplit but parallelized as each stage is (TP, AC, FSDP): what a stage holds per block
    and micro-batch (:func:`estimate_pipeline_memory`)."""
    config = trainer.config
    args = trainer.model_args
    if depth is not None:
        with_depth = getattr(args, "with_depth", None)  # a family whose blocks differ
        args = with_depth(depth) if with_depth else dataclasses.replace(args, n_layers=depth)
    # Inductor cannot trace fake tensors of an outer fake mode; compiled runs usually need
    # somewhat less activation memory than this estimate.
    # LoRA targets of numbered blocks (layers.5.attention.wq) name the same layer of every
    # probe block instead: the shallow model has no block 5 (its adapters are small next to
    # the activations either way).
    probe_lora = dataclasses.replace(
        config.lora,
        target_modules=[re.sub(r"^layers\.\d+\.", "", t) for t in config.lora.targets()],
    )
    if probe_lora.rank > 0:
        with torch.device("meta"):
            shallow = trainer.model_spec.build_model(args)
        try:
            lora.targets(shallow, probe_lora)
        except ConfigError:  # only layers the probe lacks (DeepSeek-V3's dense blocks)
            probe_lora = dataclasses.replace(probe_lora, target_modules=[])
    context = dataclasses.replace(
        trainer.parallelize_context,
        compile=dataclasses.replace(config.compile, enable=False),
        lora=probe_lora,
    )
    t = config.training
    batch_size = t.local_batch_size
    if trainer.parallel_dims.pp_enabled:
        with torch.device("meta"):
            model = trainer.model_builder.meta_model(args)
            model_parts = [trainer.model_spec.parallelize(model, context)]
        batch_size = config.parallelism.pipeline_parallel_microbatch_size
    else:
        model_parts, _ = trainer.model_builder.parts(args, context, pp_rank=trainer.pp_rank)
    with memory_estimate.fake_tensor_mode():
        for part in model_parts:
            part.to_empty(device=trainer.device)
        optimizers = build_optimizers(
            model_parts, config.optimizer, trainer.device, seed=config.debug.seed
        )
        runner = BatchRunner(
            model_parts, context, trainer.device, document_start=trainer.document_start
        )
        inputs = torch.randint(0, args.vocab_size, (batch_size, t.seq_len))
        labels = torch.randint(0, args.vocab_size, (batch_size, t.seq_len))
        parameters = [p for part in model_parts for p in part.parameters()]

        batch = runner.local_part(({"input": inputs}, labels))  # a CP rank's share

        def forward_backward() -> None:
            runner.forward_backward([batch], scale=1.0)
            dist_utils.clip_grad_norm_(parameters, t.max_norm, pp_mesh=trainer.pp_mesh)

        def optimizer_step() -> None:
            optimizers.step()
            optimizers.zero_grad()

        moments = memory_estimate.peak_by_category(
            model_parts,
            optimizers.optimizers,
            forward_backward=forward_backward,
            optimizer_step=optimizer_step,
        )
        # Frozen parameters (LoRA's base weights) have no gradient and no state.
        moments["state"] = {
            "Parameter": memory_estimate.local_bytes(parameters),
            "Gradient": memory_estimate.local_bytes(p for p in parameters if p.requires_grad),
            "Optstate": memory_estimate.local_bytes(optimizers.state_tensors()),
        }
    return moments


def estimate_pipeline_memory(trainer: Trainer) -> memory_estimate.MemoryEstimate:
    """This pipeline rank's memory: exact state bytes of its stages, and the activations of
    the micro-batches in flight at once under the schedule.

    Probes of 1 and 2 blocks (one micro-batch each, :func:`_probe_step`) give the activation
    bytes per block and those of the embeddings, output and loss (counted on the last stage,
    where the logits are). The rank's action list of one accumulation batch (the schedule's
    own lowering, as the bubble uses) then says how many micro-batches each of its stages
    holds at the worst moment: ``pipeline_timeline.peak_in_flight``. Gradients are held all
    along (they accumulate over the micro-batches), unlike without a pipeline.
    """
    p, t = trainer.config.parallelism, trainer.config.training
    one, two = _probe_step(trainer, 1), _probe_step(trainer, 2)
    ratio = two["state"]["Optstate"] / max(two["state"]["Gradient"], 1)  # per trainable byte
    # What a block holds for its backward, measured at the same moment in both probes (their
    # peaks can fall at different moments: memory_estimate.extrapolate_peak).
    per_block = max(0, two["forward"].get("Activation", 0) - one["forward"].get("Activation", 0))
    one, two = one["peak"], two["peak"]
    ends = max(0, one.get("Activation", 0) - per_block)
    # One block's backward working set beyond what blocks hold (recomputation under AC, an
    # MoE block's dispatch), counted once.
    transient = max(0, two.get("Activation", 0) - ends - 2 * per_block)
    layout = pipeline_split.pipeline_layout(p, trainer.model_args.n_layers)
    stages = layout.stages_by_rank[trainer.pp_rank]
    last = layout.num_stages - 1
    weight = {
        stage: len(part.layers) * per_block + (ends if stage == last else 0)
        for stage, part in zip(stages, trainer.model_parts, strict=True)
    }
    try:
        actions = pipeline_split.action_lists(layout, p, t.local_batch_size)[trainer.pp_rank]
        activations = pipeline_timeline.peak_in_flight(actions, weight)
    except Exception as e:  # the lowering is a private torch API: bound it instead
        logger.warning(
            f"Pipeline schedule not lowered ({type(e).__name__}: {e}); counting every "
            "micro-batch in flight on every stage (an upper bound)"
        )
        activations = sum(weight.values()) * (
            t.local_batch_size // p.pipeline_parallel_microbatch_size
        )
    parameters = [q for part in trainer.model_parts for q in part.parameters()]
    params = memory_estimate.local_bytes(parameters)
    grads = memory_estimate.local_bytes(q for q in parameters if q.requires_grad)
    optimizer = int(grads * ratio)
    peak = {
        "Activation": activations + transient,
        "Temp": max(one.get("Temp", 0), two.get("Temp", 0)),
        "Parameter": params,
        "Gradient": grads,
        "Optstate": optimizer,
    }
    peak["Total"] = sum(peak.values())
    return memory_estimate.MemoryEstimate(
        n_layers=sum(len(part.layers) for part in trainer.model_parts),
        parameters=params,
        gradients=grads,
        optimizer=optimizer,
        peak=peak,
    )


def run(trainer: Trainer) -> None:
    """Banner, memory estimate, then ``--comm.dry_run_steps`` steps."""
    logger.warning(banner(trainer))
    if torch_version() < (2, 13):
        # Measured: llama3_405b at TP 8 estimated 1.5 TB of activations on torch 2.11 against
        # 13 GiB on 2.13 (torch's fake-tensor memory tracker changed in between).
        logger.warning(
            f"The activation estimate below is checked on torch >= 2.13 only; on torch "
            f"{torch.__version__} it can be far too large (parameter, gradient and optimizer "
            "bytes are exact on any version)"
        )
    dims = trainer.parallel_dims
    if dims.pp_enabled:
        return _report_pipeline(trainer)
    estimate = estimate_memory(trainer)
    logger.info(
        f"Memory estimate for rank {trainer.rank} of {dims.world_size} ({dims}; "
        f"peak extrapolated from 1 and 2 of {estimate.n_layers} blocks):\n"
        + estimate.report(trainer.config.debug.device_memory_gib, advice=_advice(trainer.config))
    )
    if trainer.config.compile.enable:
        logger.info(COMPILED_NOTE)
    if trainer.config.model.attn_mask == "block_causal":
        args = trainer.model_args
        dense = getattr(args, "attention_sinks", False) or getattr(args, "sliding_window", 0)
        logger.info(
            "block_causal: the estimate counts the dense mask's attention (what CPU runs "
            "compiled or on DTensors take); "
            + (
                "so do CUDA runs of its full-attention blocks (sinks and windows take no "
                "FlexAttention block mask yet)"
                if dense
                else "CUDA runs take FlexAttention, which holds less"
            )
        )
    steps = trainer.config.comm.dry_run_steps
    if steps == 0:
        logger.info("Dry run finished: built and estimated, no step (--comm.dry_run_steps 0)")
        return
    if trainer.on_meta:
        # The probes above already ran the trainer's step on fake tensors, at shallow depth.
        logger.info(
            "Dry run finished: the step ran on fake tensors (1 and 2 blocks, same "
            "parallelization); pass --comm.fake_compute real to run real tensors"
        )
        return
    trainer.train(until=steps)
    logger.info(f"Dry run finished: {trainer.step} real step(s) on no-op collectives")


def _report_pipeline(trainer: Trainer) -> None:
    """Under pipeline parallelism: this rank's stages and its memory estimate. The pipeline
    step itself does not run: its stages exchange metadata before their first step, which
    no-op collectives cannot carry (``COMM_MODE=local_tensor`` runs it, with real numbers)."""
    dims, p = trainer.parallel_dims, trainer.config.parallelism
    stages = ", ".join(
        f"{n} blocks" if n != 1 else "1 block"
        for n in (len(part.layers) for part in trainer.model_parts)
    )
    estimate = estimate_pipeline_memory(trainer)
    m = trainer.config.training.local_batch_size // p.pipeline_parallel_microbatch_size
    logger.info(
        f"Memory estimate for rank {trainer.rank} of {dims.world_size} ({dims}): it holds "
        f"{len(trainer.model_parts)} pipeline stage(s) ({stages}); activations of the "
        f"micro-batches in flight at once under {_schedule_name(p)} with {m} micro-batches "
        f"of {p.pipeline_parallel_microbatch_size}, per block from 1 and 2 blocks:\n"
        + estimate.report(trainer.config.debug.device_memory_gib, advice=_advice(trainer.config))
    )
    logger.info(
        "Dry run finished: stages built and estimated; the pipeline step does not run on "
        "no-op collectives (COMM_MODE=local_tensor runs it)"
    )


def _schedule_name(p) -> str:
    return p.pipeline_parallel_schedule_csv or p.pipeline_parallel_schedule


def _advice(config: JobConfig) -> str:
    """What to change when the estimate does not fit, most effective first."""
    steps = ["lower --training.local_batch_size or --training.seq_len"]
    if config.activation_checkpoint.mode != "full":
        steps.append("use --activation_checkpoint.mode full")
    steps.append("shard over more ranks (--parallelism.tensor_parallel_degree, NGPU)")
    return "; ".join(steps)

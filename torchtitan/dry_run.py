"""``COMM_MODE=fake_backend``: validate a large job on one CPU process before launching it.

One process plays one rank (``RANK``) of a ``WORLD_SIZE``-rank job on a fake process group
(collectives return at once and move no data). The real config, mesh, model build and
parallelization run; then this module prints the rank's memory estimate and runs
``--comm.dry_run_steps`` steps: with real tensors when the step is small enough for this host,
otherwise on fake tensors, which carry shapes but no data. Values (loss, norms) mean nothing.
"""

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch

from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import memory_estimate
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.train import Trainer

REAL_STEP_FLOPS = 1e12
"""Above this many FLOPs per rank and step, ``--comm.fake_compute auto`` steps on fake tensors:
a CPU core does a few tens of GFLOP/s, so one real step would take minutes."""


def wants_fake_compute(config, model_args, parallel_dims, grad_accum_steps: int) -> bool:
    """Whether a ``fake_backend`` run should step on fake tensors (``--comm.fake_compute``)."""
    if config.comm.mode != "fake_backend":
        return False
    if config.comm.fake_compute != "auto":
        return config.comm.fake_compute == "fake"
    t = config.training
    tokens = t.local_batch_size * t.seq_len * grad_accum_steps
    flops = model_args.flops_per_token(t.seq_len) * tokens / parallel_dims.non_data_parallel_size
    return flops > REAL_STEP_FLOPS


def banner(trainer: "Trainer") -> str:
    dims = trainer.parallel_dims
    compute = "fake tensors (shapes only)" if trainer.fake_compute else "real tensors"
    return (
        f"DRY RUN (COMM_MODE=fake_backend): rank {trainer.rank} of {dims.world_size} simulated "
        f"ranks, no-op collectives, steps on {compute}. Losses, norms and other data-dependent "
        "values are meaningless; shapes, placements, memory and the config are what it checks."
    )


def estimate_memory(trainer: "Trainer") -> memory_estimate.MemoryEstimate:
    """This rank's memory: exact state bytes from the built model, peak from shallow copies."""
    args = trainer.model_args
    n_layers = getattr(args, "n_layers", None)
    peaks, ratio = [], 0.0
    for depth in (1, 2) if n_layers else (None,):
        peak, ratio = _probe_step(trainer, depth)
        peaks.append(peak)
    peak = memory_estimate.extrapolate(*peaks, n_layers) if n_layers else peaks[0]
    params = memory_estimate.local_bytes(trainer.model.parameters())
    grads = memory_estimate.local_bytes(p for p in trainer.model.parameters() if p.requires_grad)
    return memory_estimate.MemoryEstimate(
        n_layers=n_layers or 0,
        parameters=params,
        gradients=grads,
        optimizer=int(params * ratio),
        peak=peak,
    )


def _probe_step(trainer: "Trainer", depth: int | None) -> tuple[dict[str, int], float]:
    """Build the model with ``depth`` blocks (all of them for ``None``), parallelized like the
    real one, and measure a step on fake tensors. Returns the peak by category and the
    optimizer's state bytes per parameter byte."""
    from torchtitan.components.loss import cross_entropy_sum
    from torchtitan.components.optimizer import build_optimizer

    config = trainer.config
    args = (
        trainer.model_args
        if depth is None
        else dataclasses.replace(trainer.model_args, n_layers=depth)
    )
    with torch.device("meta"):
        model = trainer.model_spec.build_model(args)
    model = trainer.model_spec.parallelize(
        model,
        parallel_dims=trainer.parallel_dims,
        world_mesh=trainer.world_mesh,
        training=config.training,
        parallelism=config.parallelism,
        activation_checkpoint=config.activation_checkpoint,
        # Inductor cannot trace fake tensors of an outer fake mode; compiled runs usually
        # need somewhat less activation memory than this estimate.
        compile=dataclasses.replace(config.compile, enable=False),
    )
    t = config.training
    with memory_estimate.fake_tensor_mode():
        model.to_empty(device=trainer.device)
        optimizer = build_optimizer(model, config.optimizer, trainer.device)
        inputs = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len))
        labels = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len))
        # The trainer's own forward/backward (loss parallelism, autocast) on this model.
        probe = copy.copy(trainer)
        probe.model, probe.loss_fn = model, cross_entropy_sum

        def forward_backward() -> None:
            probe.forward_backward({"input": inputs}, labels, scale=1.0)
            dist_utils.clip_grad_norm_(model.parameters(), t.max_norm)

        def optimizer_step() -> None:
            optimizer.step()
            optimizer.zero_grad()

        peak = memory_estimate.peak_by_category(
            model, optimizer, forward_backward=forward_backward, optimizer_step=optimizer_step
        )
        state = (v for s in optimizer.state.values() for v in s.values())
        ratio = memory_estimate.local_bytes(state) / max(
            memory_estimate.local_bytes(model.parameters()), 1
        )
    return peak, ratio


def run(trainer: "Trainer") -> None:
    """Banner, memory estimate, then ``--comm.dry_run_steps`` steps."""
    logger.warning(banner(trainer))
    estimate = estimate_memory(trainer)
    dims = trainer.parallel_dims
    logger.info(
        f"Memory estimate for rank {trainer.rank} of {dims.world_size} ({dims}; "
        f"peak extrapolated from 1 and 2 of {estimate.n_layers} blocks):\n"
        + estimate.report(trainer.config.debug.device_memory_gib, advice=_advice(trainer.config))
    )
    steps = trainer.config.comm.dry_run_steps
    if steps == 0:
        logger.info("Dry run finished: built and estimated, no step (--comm.dry_run_steps 0)")
        return
    if trainer.fake_compute:
        # The probes above already ran the trainer's step on fake tensors, at shallow depth.
        logger.info(
            "Dry run finished: the step ran on fake tensors (1 and 2 blocks, same "
            "parallelization); pass --comm.fake_compute real to run real tensors"
        )
        return
    trainer.config.training.steps = min(trainer.config.training.steps, steps)
    trainer.train()
    logger.info(f"Dry run finished: {trainer.step} real step(s) on no-op collectives")


def _advice(config) -> str:
    """What to change when the estimate does not fit, most effective first."""
    steps = ["lower --training.local_batch_size or --training.seq_len"]
    if config.activation_checkpoint.mode != "full":
        steps.append("use --activation_checkpoint.mode full")
    steps.append("shard over more ranks (--parallelism.tensor_parallel_degree, NGPU)")
    return "; ".join(steps)

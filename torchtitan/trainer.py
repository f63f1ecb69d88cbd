"""The ``Trainer``: named build steps, then ``train()``, the loop of step -> log -> checkpoint.

Every consumer of the model takes ``model_parts`` (one part without pipeline parallelism):
optimizers, LR schedules, checkpoint, clipping, metrics. The batch runner moves batches through
them; the trainer decides what a step is. Debugging modes (``dry_run.py``) use the same public
build steps instead of adding branches here.
"""

import dataclasses
import time
from collections.abc import Sequence

import torch

from torchtitan.batch_runner import Batch, BatchRunner
from torchtitan.components import checkpoint_hf, float8, lora, preemption
from torchtitan.components.batch_schedule import BatchSchedule
from torchtitan.components.chat_template import ChatTemplate
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpoint_states import build_checkpoint_states
from torchtitan.components.dataloader import Tokenizer
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.nonfinite import NonFiniteSteps, drop_update
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.run_data import RunData
from torchtitan.components.run_events import RunEvents
from torchtitan.components.spikes import SpikeGuard
from torchtitan.components.train_state import StepResult, TrainState, nothing_to_train, resume_notes
from torchtitan.config import JobConfig
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import save_resolved, to_toml
from torchtitan.distributed import ParallelDims, context_parallel, local_tensor, pipeline_split
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.semi_sync import SemiSync
from torchtitan.model_builder import ModelBuilder
from torchtitan.models.spec import ParallelizeContext, get_model_spec
from torchtitan.tools import comm_trace, host_syncs, memory_estimate, profiling
from torchtitan.tools.gc import gc_every
from torchtitan.tools.logging import logger
from torchtitan.tools.memory_estimate import held_mib
from torchtitan.tools.watchdog import StepWatchdog


class Trainer:
    """Builds everything a run needs from a ``JobConfig``, then ``train()`` runs the loop.

    ``on_meta=True`` stops after building and parallelizing the model on the meta device,
    with no data and no checkpoint: enough to check shapes, placements and memory (the dry run
    of ``COMM_MODE=fake_backend`` on a model too large for this host), not to train.
    """

    def __init__(self, config: JobConfig, *, on_meta: bool = False):
        self.config = config
        self.on_meta = on_meta
        # A dry run (no-op collectives) leaves the dump folder as it found it: a real run's
        # config and metrics may be there (both default to ./outputs).
        # Neither a dry run nor a validation-only run writes records (events, config, metrics).
        self.dry = config.comm.mode == "fake_backend" or config.validation.only
        self.init_distributed()
        self.model_spec = get_model_spec(config.model.name)
        self.model_args = self.model_spec.args_for(
            config.model.flavor, seq_len=config.training.seq_len, config=config
        )
        # The model's own work after each optimizer step (MoE balancing), for flavors with it.
        self._after_optimizer_step = self.model_spec.after_optimizer_step_for(config.model.flavor)
        self.data = None if on_meta else self.build_data()
        self.dataloader = None if on_meta else self.data.training_loader()
        self.model_builder = ModelBuilder(self.model_spec, config, self.device)
        self.lora_layers = self.model_builder.check_whole_model(self.model_args)
        self.parallelize_context = ParallelizeContext.from_config(config, self.parallel_dims)
        self.model_parts, stages = self.model_builder.parts(
            self.model_args, self.parallelize_context, pp_rank=self.pp_rank
        )
        self.stage_indices = [stage.stage_index for stage in stages]  # of each model part
        for part in self.model_parts:
            lora.check_added(part, config.lora, config.model.name)
        self.model_builder.log_parameters(self.model_parts, self.model_args, self.parallel_dims)
        if not on_meta:
            if self.device.type == "cpu":  # on a GPU the state lives in the device's memory
                # Several ranks, or bf16 parameters, start from a one-process float32 init.
                whole = self.parallel_dims.meshes_built or config.training.dtype != "float32"
                memory_estimate.check_host_memory(self.model_parts, config, builds_whole=whole)
            self.model_builder.init_weights(
                self.model_parts, self.model_args, seed=self.seed, stage_indices=self.stage_indices
            )
        self.runner = BatchRunner(
            self.model_parts, self.parallelize_context, self.device,
            stages=stages, document_start=self.document_start,
        )  # fmt: skip
        self.validator = None if on_meta else self.data.validator(
            config.validation, runner=self.runner, loss_mesh=self.loss_mesh
        )  # fmt: skip
        self.pipeline_bubble = (
            pipeline_split.log_ideal_bubble(
                config.parallelism, self.model_args.n_layers, config.training.local_batch_size
            )
            if stages
            else None
        )
        self.optimizers = build_optimizers(
            self.model_parts, config.optimizer, self.device, seed=config.debug.seed
        )
        float8.after_sharding(self.model_parts, self.optimizers, config.float8)
        # A validation of saved weights needs the synced ones, which the checkpoint's model is.
        self.semi_sync = None if on_meta or config.validation.only else SemiSync.build(
            config.semi_sync, self.model_parts, self.parallel_dims,
            n_layers=self.model_args.n_layers, after_change=self.optimizers.weights_changed,
            before_change=lambda: self.checkpointer and self.checkpointer.wait_for_staging(),
        )  # fmt: skip
        self.lr_schedulers = build_lr_schedulers(
            self.optimizers, config.lr_scheduler, config.training.steps, self.batches.stages
        )
        self.metrics = self.build_metrics()
        self.train_state = TrainState()
        self._last_step = config.training.steps  # of the current train() call
        self.model_metrics: dict[str, float] = {}
        """The model's own metrics of the last step (``ModelSpec.after_optimizer_step``)."""
        # A hang needs real collectives (or a dataloader) to wait on.
        self.watchdog = (
            None
            if dist_utils.fake_collectives()
            else StepWatchdog(config.job.dump_folder, self.rank)
        )
        self.nonfinite = NonFiniteSteps(
            config.debug, self.parallel_dims, config.parallelism.fsdp_impl, self.rank,
            SpikeGuard.from_config(config.training, self.loss_mesh),
        )  # fmt: skip
        self.checkpointer = None if on_meta else self.build_checkpointer()
        if self.checkpointer is not None and config.checkpoint.enable:
            self._load_checkpoint()
        if self.semi_sync is not None:  # the loaded (or initial) weights are the synced ones
            self.semi_sync.start()
        # A seed checkpoint's run begins a new run (it writes its config, and no events).
        self.events = RunEvents(
            config.job.dump_folder,
            enabled=self.rank == 0 and not on_meta and not self.dry,
            config_file=config.job.save_config_file,
        )
        # After the load (a resume refused there leaves the previous run's config in place),
        # before this run's config is written over an earlier run's.
        self.events.set_aside_if_new(resumed=self.step > 0 and not self.forked)
        if self.rank == 0 and not self.dry and (saved := save_resolved(config)) is not None:
            logger.info(f"Resolved config written to {saved}")
        self.preemption = None if on_meta else preemption.PreemptionWatch(
            agree=torch.distributed.is_initialized() and not dist_utils.fake_collectives()
        )  # fmt: skip
        self.preempted: preemption.Preempted | None = None  # what stopped the run, if a signal

    # ---- build steps -----------------------------------------------------------------------

    def init_distributed(self) -> None:
        """Device, process group, parallel degrees and meshes, shared seed."""
        config, t = self.config, self.config.training
        self.device = dist_utils.local_device()
        world_size = dist_utils.init_distributed(
            device=self.device,
            init_timeout_seconds=config.comm.init_timeout_seconds,
            trace_buf_size=config.comm.trace_buf_size,
            comm_mode=config.comm.mode,
        )
        self.rank = local_tensor.own_rank()
        dims = self.parallel_dims = ParallelDims.from_config(
            config.parallelism, world_size, replicas_apart=config.semi_sync.method != "none"
        )
        self.batches = BatchSchedule.from_config(t, dims)
        if world_size > 1:
            dims.build_mesh(self.device.type)
        # Ranks whose tokens make up one loss (gradients are averaged over the same ranks).
        self.loss_mesh = dims.mesh("dp_cp") if dims.meshes_built else None
        self.grad_mesh = dims.gradient_mesh() if dims.meshes_built else None
        self.pp_mesh = dims.mesh("pp") if dims.meshes_built and dims.pp_enabled else None
        # This rank's place among the ranks that read different data.
        self.dp_rank = dims.mesh("dp").get_local_rank() if dims.meshes_built else 0
        logger.info(f"{dims} on {self.device}")
        if dims.cp_enabled:
            context_parallel.log_layout(config.parallelism, t.seq_len, config.model.attn_mask)
        self.seed = dist_utils.shared_seed(config.debug.seed, self.parallel_dims.meshes_built)
        # Pipeline stages draw distinct random numbers (reproducibly); the initial weights
        # still come from ``self.seed`` alone (init_weights).
        pp_rank = self.pp_rank
        dist_utils.set_determinism(
            self.seed + pp_rank,
            deterministic=config.debug.deterministic,
            warn_only=config.debug.deterministic_warn_only,
        )

    def build_data(self) -> RunData:
        """The tokenizer, chat template and dataset readers of this data-parallel rank."""
        return RunData(
            self.config.training, self.config.model, vocab_size=self.model_args.vocab_size,
            dp_rank=self.dp_rank, dp_degree=self.parallel_dims.dp_degree,
        )  # fmt: skip

    @property
    def tokenizer(self) -> Tokenizer | None:
        """``None`` for a model built on meta (no data)."""
        return self.data.tokenizer if self.data is not None else None

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The chat template of ``--training.data_format chat`` (else ``None``)."""
        return self.data.chat_template if self.data is not None else None

    def build_metrics(self) -> MetricsProcessor:
        c = self.config
        return MetricsProcessor(
            c.metrics,
            dump_folder=c.job.dump_folder,
            device=self.device,
            flops_per_token=self.model_builder.flops_per_token(self.model_args, self.lora_layers),
            rank=self.rank,
            save_rank=not self.dry and (self.rank == 0 or c.metrics.save_for_all_ranks),
            run_config=dataclasses.asdict(c),
        )

    def build_checkpointer(self) -> CheckpointManager | None:
        c = self.config.checkpoint
        if not (c.enable or c.create_seed_checkpoint):
            return None
        states = build_checkpoint_states(
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            dataloader=self.dataloader,
            train_state=self.train_state,
            spikes=self.nonfinite.spikes,
            semi_sync=self.semi_sync,
            dp_rank=self.dp_rank,
            dp_world_size=self.parallel_dims.dp_degree,
        )
        if self.config.lora.save_adapters_only:  # the frozen weights stay where they came from
            states["model"] = states["model"].without(lora.frozen_names(self.model_parts))
        if self.config.validation.only:  # the weights (and their step); nothing to train on
            states = {k: v for k, v in states.items() if k in ("model", "train_state")}
        template = self.data.template_source
        return CheckpointManager(
            c,
            dump_folder=self.config.job.dump_folder,
            states=states,
            device_type=self.device.type, run_config=to_toml(self.config),
            writes=not self.config.validation.only,  # beside the run that saves: reads only
            hf=checkpoint_hf.build_hfio(
                self.model_spec, self.model_args, self.model_parts, self.tokenizer,
                self.parallel_dims, chat_template=template,
            ),
            chat_template=template,
        )  # fmt: skip

    def _load_checkpoint(self) -> None:
        """Resume from the newest checkpoint (or start from the initial one), then say which
        saved settings this run changes."""
        config = self.config
        self.checkpointer.load()
        self.lr_schedulers.reapply(config.optimizer.lr)
        saved = self.checkpointer.saved_config(config)
        for note in resume_notes(config, saved, self.step, self.batches.stages):
            logger.warning(note)

    # ---- runs ------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.train_state.step

    @property
    def forked(self) -> bool:
        """Whether the run started from another run's step (it continues none of its own)."""
        return self.checkpointer is not None and self.checkpointer.forked_from is not None

    def create_seed_checkpoint(self) -> None:
        """Save the initial weights as ``step-0`` (model only): every later run, at any
        parallelism, that finds it starts from exactly these weights."""
        if self.parallel_dims.meshes_built:
            raise ConfigError(
                "--checkpoint.create_seed_checkpoint runs on one process with every degree 1; "
                "launch it with NGPU=1"
            )
        self.checkpointer.save(0, model_only=True)

    def train(self, *, until: int | None = None) -> None:
        """Run up to ``training.steps`` optimizer steps; ``until`` stops earlier (the run is
        not over then: no final save)."""
        t = self.config.training
        stop = t.steps if until is None else min(until, t.steps)
        self._last_step = stop
        span = f"{t.steps} steps" if stop == t.steps else f"up to step {stop} of {t.steps}"
        if self.step >= t.steps:
            logger.warning(nothing_to_train(self.step, t.steps, forked=self.forked))
            return
        lr = self.lr_schedulers.describe()
        logger.info(f"Training {span}: {self.batches.describe(t.seq_len)}; LR: {lr}")
        data_iter = iter(self.dataloader)
        first_step, trained = self.step, 0  # trained: steps this process has trained
        self.events.start(first_step, self.parallel_dims.world_size)
        self.metrics.start_run(
            first_step=first_step, last_step=stop, work=self.batches.trained_through
        )
        where = dict(dump_folder=self.config.job.dump_folder, rank=self.rank, first_step=first_step)
        graphs = None if self.dry else where["dump_folder"]  # a dry run writes nothing there
        with (
            gc_every(t.gc_freq, debug=t.gc_debug, dump_folder=graphs, rank=self.rank) as gc_tick,
            profiling.maybe_enable_profiling(self.config.profiling, **where) as profiler,
            profiling.maybe_enable_memory_snapshot(self.config.profiling, **where) as snapshots,
        ):
            while self.step < stop:
                self.train_state.step += 1
                gc_tick(self.step)
                if self.watchdog is not None:
                    nccl = self.device.type == "cuda"
                    self.watchdog.arm(self.step, trained, self.config.comm, nccl=nccl)
                start = time.perf_counter()
                batches = [next(data_iter) for _ in range(self.batches.accumulation(self.step))]
                data_seconds = time.perf_counter() - start
                if self.batches.skipped(self.step) is None:
                    self._train_and_log(batches, data_seconds, stop)
                    trained += 1
                else:
                    self._drop(first_step, stop)
                    self.metrics.exclude_seconds(time.perf_counter() - start)
                if self.watchdog is not None:
                    self.watchdog.stop()
                if profiler is not None:
                    profiler.step()
                if snapshots is not None:
                    snapshots.step()
                saved = False
                if self.checkpointer is not None:
                    self.checkpointer.poll()
                    last = self.step == t.steps
                    if saved := self.checkpointer.should_save(self.step, last=last):
                        self._save(last=last)
                if self.step < stop and self.preemption and (signum := self.preemption.requested()):
                    if not saved and preemption.can_save(self.checkpointer, self.step):
                        self._save(last=False, now=True)  # full, and not in the background
                    self.preempted = preemption.stop(signum, self.step, self.checkpointer)
                    self.events.write("preempt", step=self.step, signal=signum.name)
                    break
        status = "preempted" if self.preempted else "finished" if self.step == t.steps else "paused"
        self.events.write("end", step=self.step, status=status)
        logger.info(f"Training {status}")

    def _train_and_log(self, batches: Sequence[Batch], data_seconds: float, stop: int) -> None:
        """Train this step on its batches; validate and log when due."""
        trace = dict(dump_folder=self.config.job.dump_folder, rank=self.rank)
        debug = self.config.debug
        census = dict(trace, device=self.device, reports=self._reports(self.step))
        with (
            comm_trace.maybe_trace_collectives(self.step, debug, **trace),
            host_syncs.maybe_count_host_syncs(self.step, debug.host_sync_step, **census),
        ):
            result = self.train_step(batches)
        # Ranks of one data-parallel group share their tokens (TP, CP, PP).
        tokens = sum(labels.numel() for _, labels in batches)
        self.metrics.record_step(
            tokens=tokens // self.parallel_dims.non_data_parallel_size, data_seconds=data_seconds
        )
        self.train_state.tokens_seen += result.global_tokens
        validation = {}
        if self.validator is not None and self.validator.should_run(self.step, stop):
            validation = self.validator.run(self.step)
            self.metrics.exclude_seconds(validation.get("validation_seconds", 0.0))
        if validation or self.metrics.should_log(self.step, stop):
            self._log(result, validation)

    def _drop(self, first_step: int, stop: int) -> None:
        """A step of ``--training.skip_steps``: its batches are read and dropped, the weights
        and optimizer state left as they are; the LR schedule moves on, as the step does."""
        if (news := self.batches.skip_news(self.step, first_step, stop)) is not None:
            logger.warning(news[1])
            self.events.write("skip", step=self.step, last=news[0])
        self.lr_schedulers.step(skipped=True)
        if self.semi_sync is not None:
            self.semi_sync.after_step(self.step)

    def train_step(self, batches: Sequence[Batch]) -> StepResult:
        """Forward and backward over this rank's accumulation batches (host tensors), clip,
        then one optimizer step.

        The loss is the mean over every valid token of the global batch, whatever the split
        into ranks and accumulation batches: each batch's summed loss is divided by the global
        token count, times the data-parallel size because gradient reduction averages ranks.
        """
        self.optimizers.zero_grad()
        batches = [self.runner.local_part(batch) for batch in batches]
        # Counted on the host copies: no device sync. The sum over ranks travels on gloo.
        local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in batches)
        global_tokens = int(dist_utils.dist_reduce(local_tokens, "sum", self.loss_mesh))
        grad_tokens = global_tokens
        if self.grad_mesh is not self.loss_mesh:
            grad_tokens = int(dist_utils.dist_reduce(local_tokens, "sum", self.grad_mesh))
        dp_size = self.grad_mesh.size() if self.grad_mesh is not None else 1
        with self.nonfinite.watch(self.model_parts, self.step, self._last_checkpoint):
            loss_sum = self.runner.forward_backward(batches, scale=dp_size / max(grad_tokens, 1))
        parameters = [p for part in self.model_parts for p in part.parameters()]
        norm = dist_utils.clip_grad_norm_(
            parameters, self.config.training.max_norm, pp_mesh=self.pp_mesh
        )
        if self.semi_sync is not None:  # each replica clipped by its own norm; one verdict
            norm = self.semi_sync.agreed_norm(norm)
        lr = self.config.optimizer.lr * self.lr_schedulers.factor()  # the unscaled groups'
        result = StepResult(loss_sum, local_tokens, global_tokens, norm, lr)
        if self.checkpointer is not None:  # a pinned-memory save may still read the weights
            self.checkpointer.wait_for_staging()
        stepped = self.nonfinite.should_step(
            self.step, result, local_loss=lambda: self._own(result.local_loss),
            last_checkpoint=self._last_checkpoint, events=self.events,
        )  # fmt: skip
        if stepped:
            self.optimizers.step(self.step)
        else:  # a non-finite norm or a spike (or the run stopped): no trace of the step
            drop_update(self.optimizers, self.model_parts)
        self.lr_schedulers.step()
        if self.semi_sync is not None:  # the replicas meet on schedule, updated or not
            self.semi_sync.after_step(self.step)
        # A skipped update moves and reports nothing (drop_update cleared its routing counts).
        self.model_metrics = {}
        if self._after_optimizer_step is not None and stepped:
            group = self.loss_mesh.get_group() if self.loss_mesh is not None else None
            pp = self.pp_mesh.get_group() if self.pp_mesh is not None else None
            # Metrics read values on the host: only on the steps that log them.
            self.model_metrics = self._after_optimizer_step(
                self.model_parts, group, pp, report=self._reports(self.step)
            )
        return result

    def close(self) -> None:
        """Finish pending checkpoint writes, flush the metrics; once (later calls do nothing)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.preemption is not None:
            self.preemption.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.metrics.close()

    # ---- helpers ---------------------------------------------------------------------------

    def _save(self, *, last: bool, now: bool = False) -> None:
        start = time.perf_counter()
        self.checkpointer.save(self.step, last=last, now=now)
        self.events.write("checkpoint", step=self.step, seconds=time.perf_counter() - start)

    def _last_checkpoint(self) -> object:
        """The last complete checkpoint to resume from (``None``: none)."""
        return self.checkpointer.last_complete() if self.checkpointer is not None else None

    def _reports(self, step: int) -> bool:
        """Whether ``step`` logs a line (a validation step logs one too)."""
        return self.metrics.should_log(step, self._last_step) or (
            self.validator is not None and self.validator.should_run(step, self._last_step)
        )

    @property
    def document_start(self) -> int | None:
        """The token that starts a document, where attention is block-causal (``None``: causal).
        A model built on meta has no tokenizer: any token id shapes the mask alike."""
        if self.config.model.attn_mask != "block_causal":
            return None
        return self.tokenizer.bos_id if self.tokenizer is not None else 0

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline coordinate (0 without pipeline parallelism)."""
        if self.pp_mesh is None:
            return 0
        return local_tensor.same_int(self.pp_mesh.get_local_rank())

    def _log(self, result: StepResult, validation: dict[str, float]) -> None:
        local_loss = self._own(result.local_loss)
        loss = result.global_loss(self.loss_mesh)
        loss_max = dist_utils.dist_reduce(result.local_loss, "max", self.loss_mesh)
        extra = {"loss_local": local_loss} | self.nonfinite.counts()
        extra |= self.batches.record(self.step, self.train_state.tokens_seen)
        extra |= self.model_metrics | validation
        extra |= self.semi_sync.metrics(self.step) if self.semi_sync is not None else {}
        idle = self.runner.take_pipeline_idle()
        if idle is not None:
            extra["pp_idle_pct"] = 100 * idle
        if self.pipeline_bubble is not None:
            extra["pp_bubble_ideal_pct"] = 100 * self.pipeline_bubble
        if self.step == 1:
            parameters = (p for part in self.model_parts for p in part.parameters())
            extra |= held_mib(parameters, self.optimizers.state_tensors())
        self.metrics.log(
            self.step,
            loss=loss,
            loss_max=loss_max,
            grad_norm=result.grad_norm.item(),
            lr=result.lr,
            extra=extra,
        )

    def _own(self, t: torch.Tensor) -> float:
        """This rank's value of a per-rank scalar (rank ``RANK``'s when ranks are simulated)."""
        return local_tensor.value_on_rank(t, self.rank).item()

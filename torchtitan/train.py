"""The trainer: ``python -m torchtitan.train --module llama3 --config llama3_debugmodel [flags]``.

A run is: build (process group, meshes, data, model, optimizer), then a loop of
step -> log, then a clean shutdown. Launch several ranks with ``./run_train.sh``.
"""

import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Sequence

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan import dry_run
from torchtitan.components.checkpoint import CheckpointManager, build_checkpoint_states
from torchtitan.components.dataloader import build_dataloader
from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import build_optimizer
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.components.train_state import StepResult, TrainState
from torchtitan.config import JobConfig
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args, save_resolved, to_toml
from torchtitan.distributed import ParallelDims, local_tensor, tensor_parallel
from torchtitan.distributed import utils as dist_utils
from torchtitan.models import import_model_module
from torchtitan.tools import comm_trace, profiling
from torchtitan.tools.gc import gc_every
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.memory_estimate import held_mib
from torchtitan.tools.paths import resolve_path
from torchtitan.tools.watchdog import StepWatchdog

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class NonFiniteError(RuntimeError):
    """A step produced a NaN or infinite gradient norm."""


def refuse_unimplemented(config: JobConfig) -> None:
    """Fail on features whose config fields exist but whose implementation lands later."""
    p = config.parallelism
    requested = {
        "--parallelism.pipeline_parallel_degree > 1": p.pipeline_parallel_degree > 1,
        "--parallelism.context_parallel_degree > 1": p.context_parallel_degree > 1,
        "--parallelism.expert_parallel_degree > 1": p.expert_parallel_degree > 1,
        "--float8.enable": config.float8.enable,
        "--validation.enable": config.validation.enable,
    }
    for flag, asked in requested.items():
        if asked:
            raise ConfigError(f"{flag} is not implemented yet; remove the flag to train without it")


class Trainer:
    """Builds everything a run needs from a ``JobConfig``, then ``train()`` runs the loop."""

    def __init__(self, config: JobConfig):
        self.config = config
        refuse_unimplemented(config)
        self._init_distributed()
        self._resolve_model()
        self._build_data()
        self._build_model()
        self.optimizer = build_optimizer(self.model, config.optimizer, self.device)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, config.lr_scheduler, training_steps=config.training.steps
        )
        self.autocast = self._autocast()
        self.metrics = MetricsProcessor(
            config.metrics,
            dump_folder=config.job.dump_folder,
            device=self.device,
            flops_per_token=self.model_args.flops_per_token(config.training.seq_len),
            rank=self.rank,
            save_rank=self.rank == 0 or config.metrics.save_for_all_ranks,
        )
        if self.rank == 0 and (saved := save_resolved(config)) is not None:
            logger.info(f"Resolved config written to {saved}")
        self.train_state = TrainState()
        self.skipped_steps = 0
        self.watchdog = None
        if config.comm.mode == "default":
            self.watchdog = StepWatchdog(config.job.dump_folder, self.rank)
        self.checkpointer = self._build_checkpointer()
        if self.checkpointer is not None and config.checkpoint.enable:
            self.checkpointer.load()

    @property
    def step(self) -> int:
        return self.train_state.step

    def create_seed_checkpoint(self) -> None:
        """Save the initial weights as ``step-0`` (model only): every later run, at any
        parallelism, that finds it starts from exactly these weights."""
        if self.world_mesh is not None:
            raise ConfigError(
                "--checkpoint.create_seed_checkpoint runs on one process with every degree 1; "
                "launch it with NGPU=1"
            )
        self.checkpointer.save(0, model_only=True)

    def _build_checkpointer(self) -> CheckpointManager | None:
        c = self.config.checkpoint
        if not (c.enable or c.create_seed_checkpoint):
            return None
        if self.config.comm.mode == "fake_backend":
            logger.warning("Checkpointing is off under COMM_MODE=fake_backend (no real values)")
            return None
        states = build_checkpoint_states(
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader,
            train_state=self.train_state,
            dp_rank=self.dp_rank,
            dp_world_size=self.parallel_dims.dp_degree,
        )
        return CheckpointManager(
            c,
            dump_folder=self.config.job.dump_folder,
            states=states,
            model=self.model,
            device_type=self.device.type,
            run_config=to_toml(self.config),
        )

    def _init_distributed(self) -> None:
        """Device, process group, parallel degrees and meshes, shared seed."""
        config = self.config
        self.device = dist_utils.local_device()
        world_size = dist_utils.init_distributed(
            device=self.device,
            init_timeout_seconds=config.comm.init_timeout_seconds,
            trace_buf_size=config.comm.trace_buf_size,
            comm_mode=config.comm.mode,
        )
        self.rank = int(os.environ.get("RANK", "0"))
        self.parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
        self.grad_accum_steps = self._grad_accum_steps()
        self.world_mesh = None
        if world_size > 1:
            self.world_mesh = self.parallel_dims.build_mesh(self.device.type)
        # Ranks whose tokens make up one loss (gradients are averaged over the same ranks).
        self.loss_mesh = self.parallel_dims.mesh("dp_cp") if self.world_mesh is not None else None
        # This rank's place among the ranks that read different data.
        dp_mesh = self.parallel_dims.mesh("dp") if self.world_mesh is not None else None
        self.dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        logger.info(
            f"{self.parallel_dims} on {self.device}, gradient accumulation {self.grad_accum_steps}"
        )
        self.seed = self._shared_seed(config.debug.seed)
        dist_utils.set_determinism(
            self.seed,
            deterministic=config.debug.deterministic,
            warn_only=config.debug.deterministic_warn_only,
        )

    def _resolve_model(self) -> None:
        """The model family and its args for this run; whether a dry run steps on fake tensors."""
        m, t = self.config.model, self.config.training
        self.model_spec = import_model_module(m.name).model_spec()
        self.model_args = dataclasses.replace(
            self.model_spec.flavors[m.flavor], max_seq_len=t.seq_len
        )
        self.fake_compute = dry_run.wants_fake_compute(
            self.config, self.model_args, self.parallel_dims, self.grad_accum_steps
        )

    def _build_data(self) -> None:
        """Tokenizer and this data-parallel rank's dataloader (none for a fake-tensor dry run)."""
        t = self.config.training
        self.tokenizer, self.dataloader = None, None
        if self.fake_compute:
            return
        self.tokenizer = build_tokenizer(resolve_path(self.config.model.tokenizer_path))
        loader = functools.partial(
            build_dataloader,
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            tokenizer=self.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            dp_world_size=self.parallel_dims.dp_degree,
            num_workers=t.num_workers,
            sharding=t.data_sharding,
        )
        if local_tensor.is_simulating():  # one process reads for every data-parallel rank
            loaders = [loader(dp_rank=r) for r in range(self.parallel_dims.dp_degree)]
            self.dataloader = local_tensor.PerRankBatches(loaders, self.dp_rank)
        else:
            self.dataloader = loader(dp_rank=self.dp_rank)

    def _build_model(self) -> None:
        """Model on the meta device -> parallelize -> materialise on the device -> init.

        A fake-tensor dry run stops after parallelizing: the parameters stay on meta.
        """
        m, t, spec = self.config.model, self.config.training, self.model_spec
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.model_args.vocab_size:
            raise ConfigError(
                f"tokenizer {m.tokenizer_path} has {self.tokenizer.vocab_size} tokens but "
                f"--model.flavor {m.flavor} has vocab_size {self.model_args.vocab_size}; "
                "pick a matching --model.tokenizer_path or flavor"
            )
        with torch.device("meta"):
            model = spec.build_model(self.model_args)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info(f"Model {m.name} {m.flavor}: {n_params:,} parameters")
        model = spec.parallelize(
            model,
            parallel_dims=self.parallel_dims,
            world_mesh=self.world_mesh,
            training=t,
            parallelism=self.config.parallelism,
            activation_checkpoint=self.config.activation_checkpoint,
            compile=self.config.compile,
        )
        self.model = model
        self.loss_fn = cross_entropy_sum
        self.loss_parallel = (
            self.parallel_dims.tp_enabled and not self.config.parallelism.disable_loss_parallel
        )
        if self.fake_compute:
            return
        build_full = functools.partial(spec.build_model, self.model_args)
        if local_tensor.is_simulating():  # every simulated rank cuts its shards of one init
            with local_tensor.host_only():
                full = dist_utils.build_full_init(build_full, self.seed)
            local_tensor.load_full_model_(model, full)
            return self._finish_model()
        model.to_empty(device=self.device)
        # Initial weights depend only on the seed and the flavor, never on the parallelism.
        torch.manual_seed(self.seed)
        with torch.no_grad():
            model.init_weights(buffer_device=self.device)
        real_collectives = self.config.comm.mode == "default"
        if self.world_mesh is not None and self.device.type == "cpu" and real_collectives:
            # DTensor random ops on CPU draw the same numbers on every shard (no offset-based
            # RNG as on CUDA), which would duplicate heads and hidden units. Use the values a
            # one-process init gives instead: rank 0 builds them, every rank takes its part.
            dist_utils.load_full_init_from_rank0(model, build_full, self.seed)
        self._finish_model()

    def _finish_model(self) -> None:
        self.model.train()
        c = self.config.compile
        # Compiled, the vocab-sharded loss ignores loss_parallel and returns a wrong value.
        if c.enable and "loss" in c.components and not self.loss_parallel:
            self.loss_fn = torch.compile(cross_entropy_sum, backend=c.backend)

    def train(self) -> None:
        """Run ``training.steps`` optimizer steps."""
        t = self.config.training
        logger.info(
            f"Training {t.steps} steps: global batch {self.global_batch_size} x {t.seq_len} tokens "
            f"({self.grad_accum_steps} micro-batch(es) of {t.local_batch_size} per rank)"
        )
        data_iter = iter(self.dataloader)
        first_step = self.step
        where = dict(dump_folder=self.config.job.dump_folder, rank=self.rank, first_step=first_step)
        with (
            gc_every(t.gc_freq) as gc_tick,
            profiling.maybe_enable_profiling(self.config.profiling, **where) as profiler,
            profiling.maybe_enable_memory_snapshot(self.config.profiling, **where) as snapshots,
        ):
            while self.step < t.steps:
                self.train_state.step += 1
                gc_tick(self.step)
                self._watch_step(first_step)
                start = time.perf_counter()
                microbatches = [next(data_iter) for _ in range(self.grad_accum_steps)]
                data_seconds = time.perf_counter() - start
                trace = dict(dump_folder=where["dump_folder"], rank=self.rank)
                with comm_trace.maybe_trace_collectives(self.step, self.config.debug, **trace):
                    result = self.train_step(microbatches)
                # Ranks of one data-parallel group share their tokens (TP, CP, PP).
                tokens = sum(labels.numel() for _, labels in microbatches)
                self.metrics.record_step(
                    tokens=tokens // self.parallel_dims.non_data_parallel_size,
                    data_seconds=data_seconds,
                )
                self.train_state.tokens_seen += result.global_tokens
                if self.metrics.should_log(self.step, t.steps):
                    self._log(result)
                if self.watchdog is not None:
                    self.watchdog.stop()
                if profiler is not None:
                    profiler.step()
                if snapshots is not None:
                    snapshots.step()
                if self.checkpointer is not None:
                    self.checkpointer.poll()
                    last = self.step == t.steps
                    if self.checkpointer.should_save(self.step, last=last):
                        self.checkpointer.save(self.step, last=last)
        logger.info("Training finished")

    def train_step(self, microbatches: Sequence[Batch]) -> StepResult:
        """Forward and backward over the (host) micro-batches, clip, then one optimizer step.

        The loss is the mean over every valid token of the global batch, whatever the split
        into ranks and micro-batches: each micro-batch's summed loss is divided by the global
        token count, times the data-parallel size because gradient reduction averages ranks.
        """
        self.optimizer.zero_grad()
        # Counted on the host copies: no device sync. The sum over ranks travels on gloo.
        local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches)
        global_tokens = int(dist_utils.dist_reduce(local_tokens, "sum", self.loss_mesh))
        dp_size = self.loss_mesh.size() if self.loss_mesh is not None else 1
        scale = dp_size / max(global_tokens, 1)
        # float64: adding float32 micro-batch sums is then exact, so the logged loss does not
        # depend on how the global batch is split into ranks and micro-batches.
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        for i, batch in enumerate(microbatches):
            if isinstance(self.model, FSDPModule):
                # Reduce gradients once, after the last micro-batch.
                self.model.set_requires_gradient_sync(i == len(microbatches) - 1)
            inputs, labels = self._to_device(batch)
            loss_sum += self.forward_backward(inputs, labels, scale)
        grad_norm = dist_utils.clip_grad_norm_(
            self.model.parameters(), self.config.training.max_norm
        )
        lr = self.lr_scheduler.get_last_lr()[0]
        # The norm is global, so every rank takes the same branch.
        finite = self.config.comm.mode == "fake_backend" or bool(torch.isfinite(grad_norm))
        result = StepResult(loss_sum, local_tokens, global_tokens, grad_norm, lr)
        if self.checkpointer is not None:  # a pinned-memory save may still read the weights
            self.checkpointer.wait_for_staging()
        if finite:
            self.optimizer.step()
        else:
            self._skip_nonfinite_step(result)
        self.lr_scheduler.step()
        return result

    def _skip_nonfinite_step(self, result: StepResult) -> None:
        """Stop the run on a non-finite gradient norm, or skip the update when asked to."""
        local_loss, grad_norm = self._own(result.local_loss), result.grad_norm
        if self.config.debug.skip_nonfinite_steps:
            self.optimizer.zero_grad()
            self.skipped_steps += 1
            logger.warning(
                f"Step {self.step}: gradient norm {grad_norm.item()}, this rank's loss "
                f"{local_loss}; update skipped ({self.skipped_steps} so far)"
            )
            return
        last = self.checkpointer.last_complete() if self.checkpointer is not None else None
        raise NonFiniteError(
            f"step {self.step}: the gradient norm is {grad_norm.item()} (rank {self.rank}: "
            f"its own loss is {local_loss}); last good checkpoint: "
            f"{last if last is not None else 'none'}. Lower --optimizer.lr, check the data, "
            "or pass --debug.skip_nonfinite_steps to skip such updates"
        )

    def _watch_step(self, first_step: int) -> None:
        """Arm the hang watchdog; after the first step collectives get the train timeout."""
        if self.watchdog is None:
            return
        comm = self.config.comm
        first = self.step == first_step + 1
        if self.step == first_step + 2 and self.device.type == "cuda":
            # NCCL dumps its flight recorder when a collective times out. On gloo the
            # watchdog enforces the timeout (a gloo timeout error would leave no dump).
            dist_utils.set_pg_timeouts(comm.train_timeout_seconds)
        timeout = comm.init_timeout_seconds if first else comm.train_timeout_seconds
        self.watchdog.start(self.step, timeout)

    def forward_backward(
        self, inputs: dict[str, torch.Tensor], labels: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One micro-batch: forward, summed loss, backward of ``loss * scale``.

        Returns the summed loss, detached. This is the piece a pipeline schedule replaces
        (it runs forward and backward over micro-batches itself).
        """
        with tensor_parallel.loss_parallel_context(self.loss_parallel), self.autocast:
            logits = self.model(inputs["input"])
            loss = self.loss_fn(logits, labels)
            del logits
            (loss * scale).backward()
        loss = loss.detach()
        # Under loss parallelism the loss is a DTensor, already summed over the TP ranks.
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.metrics.close()

    @property
    def global_batch_size(self) -> int:
        t = self.config.training
        return t.local_batch_size * self.parallel_dims.dp_degree * self.grad_accum_steps

    def _grad_accum_steps(self) -> int:
        t = self.config.training
        per_step = t.local_batch_size * self.parallel_dims.dp_degree
        if t.global_batch_size == -1:
            return 1
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"--training.global_batch_size={t.global_batch_size} must be a multiple of "
                f"--training.local_batch_size x data-parallel degree = {t.local_batch_size} x "
                f"{self.parallel_dims.dp_degree} = {per_step}"
            )
        return t.global_batch_size // per_step

    def _shared_seed(self, seed: int | None) -> int:
        """Every rank must initialise replicated state alike: without ``--debug.seed``, rank 0
        draws a seed and shares it."""
        if seed is not None:
            return seed
        drawn = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
        if self.world_mesh is not None:
            torch.distributed.broadcast(drawn, src=0)
        return int(drawn)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 compute through autocast, unless data parallelism's mixed-precision policy
        (FSDP, HSDP, replicate) already casts the parameters."""
        dims = self.parallel_dims
        policy_casts = dims.fsdp_enabled or dims.dp_replicate_enabled
        if self.config.training.mixed_precision_param == "float32" or policy_casts:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _to_device(self, batch: Batch) -> Batch:
        inputs, labels = batch
        moved = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}
        return moved, labels.to(self.device, non_blocking=True)

    def _log(self, result: StepResult) -> None:
        local_loss = self._own(result.local_loss)
        loss = dist_utils.dist_reduce(result.loss_sum, "sum", self.loss_mesh) / max(
            result.global_tokens, 1
        )
        loss_max = dist_utils.dist_reduce(result.local_loss, "max", self.loss_mesh)
        extra = {"loss_local": local_loss, "skipped_steps": self.skipped_steps}
        if self.step == 1:
            extra |= held_mib(self.model, self.optimizer)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, train, shut down; bad input exits 2 with one line, not a traceback per rank."""
    init_logger()
    trainer = None
    try:
        config = parse_args(argv)
        with local_tensor.simulate(config.comm.mode):
            trainer = Trainer(config)
            if config.comm.mode == "fake_backend":
                dry_run.run(trainer)
            elif config.checkpoint.create_seed_checkpoint:
                trainer.create_seed_checkpoint()
            else:
                trainer.train()
        return 0
    except (ConfigError, FileNotFoundError) as e:
        logger.error(str(e))
        return 2
    except NonFiniteError as e:
        logger.error(str(e))
        return 3
    finally:
        if trainer is not None:
            trainer.close()
        dist_utils.shutdown()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch's CPU build sometimes aborts at interpreter exit after a clean shutdown
    # ("terminate called without an active exception"); everything is flushed, so skip it.
    os._exit(code)

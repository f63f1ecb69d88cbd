"""What a run does about NaN and infinite values: ``--debug.detect_anomaly``'s watch over each
step's forward and backward (:mod:`torchtitan.components.anomaly`), and what follows a
non-finite gradient norm: the run stops in one line (exit 3), or with
``--debug.skip_nonfinite_steps`` the update is skipped and counted. Finite steps whose loss or
gradient norm spikes are skipped too with ``--training.spike_sigma``
(:mod:`torchtitan.components.spikes`)."""

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from torchtitan.components import anomaly
from torchtitan.components.optimizer import Optimizers
from torchtitan.components.run_events import RunEvents
from torchtitan.components.spikes import SpikeGuard
from torchtitan.components.train_state import NonFiniteError, StepResult
from torchtitan.config.job_config import Debug
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.moe import moe_layers
from torchtitan.tools.logging import logger


class NonFiniteSteps:
    """One run's watch and verdicts; ``skipped`` counts the updates skipped so far."""

    def __init__(
        self,
        debug: Debug,
        dims: ParallelDims,
        fsdp_impl: str,
        rank: int,
        spikes: SpikeGuard | None = None,
    ):
        # Meaningless values (a dry run's) are not looked at.
        self.real = dist_utils.values_are_real()
        self.detect = debug.detect_anomaly and self.real
        self.spikes = spikes
        self.per_op = anomaly.per_op_checks(dims, fsdp_impl)
        self.skip = debug.skip_nonfinite_steps
        self.rank = rank
        self.skipped = 0
        if self.detect:
            what = anomaly.checked(self.per_op)
            logger.info(f"--debug.detect_anomaly: each step checks {what} (slower steps)")

    def watch(
        self,
        model_parts: Sequence[nn.Module],
        step: int,
        last_checkpoint: Callable[[], object],
    ) -> contextlib.AbstractContextManager:
        """Around a step's forward and backward: ``--debug.detect_anomaly``'s checks (else
        nothing)."""
        if not self.detect:
            return contextlib.nullcontext()
        return anomaly.watch(
            model_parts,
            step=step,
            rank=self.rank,
            per_op=self.per_op,
            last_checkpoint=last_checkpoint,
        )

    def should_step(
        self,
        step: int,
        result: StepResult,
        *,
        local_loss: Callable[[], float],
        last_checkpoint: Callable[[], object],
        events: RunEvents,
    ) -> bool:
        """Whether ``step``'s update applies: not when its gradient norm is not finite (the run
        stops, or the update is skipped) or when it spikes (``--training.spike_sigma``). The
        norm and the loss are global, so every rank decides alike. ``local_loss``: this rank's
        loss, read only for the stop line."""
        if not self.real:
            return True
        if not bool(torch.isfinite(result.grad_norm)):
            self.after_step(step, result.grad_norm, local_loss(), last_checkpoint)
            return False
        if self.spikes is None or (verdict := self.spikes.judge(step, result)) is None:
            return True
        logger.warning(verdict)
        events.write("spike", step=step, why=verdict)
        return False

    def counts(self) -> dict[str, int]:
        """What a logged record says of the skipped updates so far."""
        spikes = {} if self.spikes is None else {"spike_skipped_steps": self.spikes.skipped}
        return {"skipped_steps": self.skipped} | spikes

    def after_step(
        self,
        step: int,
        grad_norm: torch.Tensor,
        local_loss: float,
        last_checkpoint: Callable[[], object],
    ) -> None:
        """After a step whose gradient norm is not finite: raise the ``NonFiniteError`` that
        stops the run, or, when skipping, count the step and say so (the caller drops its
        gradients)."""
        if not self.skip:
            raise NonFiniteError.at_step(
                step,
                grad_norm.item(),
                self.rank,
                local_loss,
                last_checkpoint(),
                checked=anomaly.checked(self.per_op) if self.detect else None,
            )
        self.skipped += 1
        logger.warning(
            f"Step {step}: gradient norm {grad_norm.item()}, this rank's loss "
            f"{local_loss}; update skipped ({self.skipped} so far)"
        )


def drop_update(optimizers: Optimizers, model_parts: Sequence[nn.Module]) -> None:
    """A step whose update is skipped leaves nothing behind: its gradients are dropped, and so
    are the routing counts its forward added to MoE layers (they would move the next step's
    expert biases), as if its batches had never run."""
    optimizers.zero_grad()
    for _, layer in moe_layers(list(model_parts)):
        layer.tokens_per_expert.zero_()

"""What the training loop carries from step to step, and what one step returns."""

import dataclasses

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.components.batch_schedule import resumed_batch_note
from torchtitan.components.lr_scheduler import Stages, resumed_note_for
from torchtitan.components.optimizer import changed_settings_note
from torchtitan.config import JobConfig
from torchtitan.distributed import utils as dist_utils


class NonFiniteError(RuntimeError):
    """A step produced a NaN or infinite gradient norm."""

    @classmethod
    def at_step(
        cls,
        step: int,
        grad_norm: float,
        rank: int,
        local_loss: float,
        last_checkpoint: object,
        *,
        checked: str | None = None,
    ) -> "NonFiniteError":
        """The one line that stops the run, with what to do about it. ``checked``: what
        ``--debug.detect_anomaly`` checked in this step (and found finite)."""
        found = (
            f" (--debug.detect_anomaly checked {checked} and found none: a parameter's "
            "gradient, its reduction or the norm overflowed)"
            if checked
            else "; --debug.detect_anomaly finds the module where it starts"
        )
        return cls(
            f"step {step}: the gradient norm is {grad_norm} (rank {rank}: its own loss is "
            f"{local_loss}){found}; last good checkpoint: "
            f"{last_checkpoint if last_checkpoint is not None else 'none'}. Lower "
            f"--optimizer.lr, check the data (resume skipping it: --training.skip_steps {step}), "
            "or pass --debug.skip_nonfinite_steps to skip such updates"
        )

    @classmethod
    def located(cls, step: int, rank: int, what: str, last_checkpoint: object) -> "NonFiniteError":
        """The one line of ``--debug.detect_anomaly``: where the first non-finite value came
        from (``what``)."""
        return cls(
            f"step {step}, rank {rank}: {what}; last good checkpoint: "
            f"{last_checkpoint if last_checkpoint is not None else 'none'}. Lower "
            "--optimizer.lr or check the data (docs/debugging.md, Non-finite loss or gradients)"
        )


@dataclasses.dataclass
class TrainState(Stateful):
    """Where training stands; restored from a checkpoint with everything else."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "step": torch.tensor(self.step),
            "tokens_seen": torch.tensor(self.tokens_seen),
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        torch.set_rng_state(state_dict["rng"])


@dataclasses.dataclass
class StepResult:
    loss_sum: torch.Tensor
    """Summed token losses of this rank's accumulation batches."""
    local_tokens: torch.Tensor
    """Valid (not ignored) tokens of this rank's accumulation batches; like ``loss_sum``, one value
    per rank when ranks are simulated (``COMM_MODE=local_tensor``)."""
    global_tokens: int
    grad_norm: torch.Tensor
    lr: float
    """Learning rate this step used."""
    _global_loss: float | None = dataclasses.field(default=None, repr=False)

    @property
    def local_loss(self) -> torch.Tensor:
        """This rank's mean token loss."""
        return self.loss_sum / self.local_tokens.clamp(min=1)

    def global_loss(self, mesh: DeviceMesh | None) -> float:
        """The mean token loss over the ranks of ``mesh`` (the data-parallel ones): summed
        once, then kept (the spike guard and the log line both read it)."""
        if self._global_loss is None:
            total = dist_utils.dist_reduce(self.loss_sum, "sum", mesh)
            self._global_loss = total / max(self.global_tokens, 1)
        return self._global_loss


def nothing_to_train(step: int, steps: int, *, forked: bool) -> str:
    """The warning of a run that resumed (or forked another) at or past its last step."""
    return (
        f"Nothing to train: the run {'forked another' if forked else 'resumed'} at step {step}, "
        f"and --training.steps is {steps}; raise --training.steps to train on "
        "(docs/checkpoint.md), or "
        + ("fork an earlier step" if forked else "pick another --job.dump_folder")
        + " for a new run"
    )


def resume_notes(
    config: JobConfig, saved: JobConfig | None, step: int, stages: Stages
) -> list[str]:
    """What a run resumed at ``step`` from a checkpoint saved with the config ``saved`` changes
    (the LR curve, optimizer settings, the batch): one warning each. ``saved``: ``None`` when
    the checkpoint holds no config."""
    notes = [resumed_note_for(config, saved, step, stages)]
    if saved is not None and step > 0 and not config.validation.only:
        notes.append(changed_settings_note(config.optimizer, saved.optimizer))
        notes.append(resumed_batch_note(config.training, saved.training, step))
    return [note for note in notes if note is not None]

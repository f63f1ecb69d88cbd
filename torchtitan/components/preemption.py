"""Preemption: SIGTERM or SIGUSR1 asks the run to stop at the end of the current step, save a
checkpoint and exit with ``EXIT_CODE``, so a scheduler can requeue it and the next run resumes
from exactly that step.

Slurm sends SIGTERM at the end of a job's time (``KillWait`` seconds before SIGKILL), the
signal of ``--signal=USR1@SECONDS`` that long before it, and whatever ``scancel --signal``
names. The signal reaches each rank at its own moment; the ranks agree on the step to stop at
with one small all-reduce (MAX) per step over the default group's CPU backend (gloo), which
holds no device stream.
"""

import signal
import threading
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from torchtitan.tools.logging import logger

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_CODE = 75
"""Exit status of a preempted run whose checkpoint is saved (``EX_TEMPFAIL``: try again)."""


class PreemptionWatch:
    """Installs handlers for ``SIGNALS`` that only take note; ``requested()`` after each step
    says (the same on every rank) whether any rank was signalled."""

    def __init__(self, *, agree: bool):
        """``agree``: reduce the request over the default process group (real collectives)."""
        self._agree = agree
        self._received: int = 0
        self._announced = False
        # Handlers belong to the main thread (simulated pipeline ranks run in others).
        main = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.signal(s, self._note) for s in SIGNALS} if main else {}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # Only take note: a handler runs between any two bytecodes, even inside a log call.
        self._received = self._received or signum

    def requested(self) -> signal.Signals | None:
        """The signal that asks every rank to stop now, or None to go on."""
        received = self._received
        if received and not self._announced:
            self._announced = True
            logger.warning(f"Received {signal.Signals(received).name}: stopping after this step")
        if self._agree:
            flag = torch.tensor([received], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            received = int(flag.item())
        return signal.Signals(received) if received else None

    def close(self) -> None:
        """Put back the handlers that were there before."""
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)


@dataclass(frozen=True)
class Preempted:
    """Why and where a run stopped early, and the checkpoint it saved (None: checkpointing
    is off)."""

    signal: signal.Signals
    step: int
    checkpoint: str | None

    def message(self) -> str:
        if self.checkpoint is None:
            return (
                f"Preempted by {self.signal.name} after step {self.step} with checkpointing off "
                f"(--checkpoint.enable): nothing was saved, a new run starts from scratch"
            )
        return (
            f"Preempted by {self.signal.name} after step {self.step}: saved {self.checkpoint}; "
            f"the same command resumes from it"
        )


def can_save(checkpointer, step: int) -> bool:
    """Whether this run saves checkpoints at all (a ``CheckpointManager`` that is enabled and
    not load-only)."""
    return checkpointer is not None and checkpointer.should_save(step, last=True)


def stop(signum: signal.Signals, step: int, checkpointer) -> Preempted:
    """End a preempted run: wait for the checkpoint of ``step`` (saved by the caller) to be
    complete on disk, since the job may be killed soon after this process ends."""
    path = None
    if can_save(checkpointer, step):
        checkpointer.finish_pending()
        path = str(checkpointer.folder / f"step-{step}")
    preempted = Preempted(signum, step, path)
    logger.warning(preempted.message())
    return preempted

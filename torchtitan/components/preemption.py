"""Preemption: SIGTERM or SIGUSR1 asks the run to stop at the end of the current step, save a
checkpoint and exit with ``EXIT_CODE``, so a scheduler can requeue it and the next run resumes
from exactly that step.

Slurm sends SIGTERM at the end of a job's time (``KillWait`` seconds before SIGKILL), the
signal of ``--signal=USR1@SECONDS`` that long before it, and whatever ``scancel --signal``
names. The signal reaches each rank at its own moment; the ranks agree on the step to stop at
with a one-integer all-reduce (MAX) over the default group's CPU backend (gloo: no device
stream is held). It runs in the background: started after step N, read after step N+1, so a
signal costs one more step and the check never stalls a step (a blocking reduce would put a
barrier of all ranks, with gloo's latency growing with their count, into every step).
"""

import signal
import threading
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from torchtitan.distributed import local_tensor
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
        self._pending: tuple[dist.Work, torch.Tensor] | None = None  # the reduce in flight
        # Handlers belong to the main thread (simulated pipeline ranks run in others).
        main = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.signal(s, self._note) for s in SIGNALS} if main else {}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # Only take note: a handler runs between any two bytecodes, even inside a log call.
        self._received = self._received or signum

    def requested(self) -> signal.Signals | None:
        """The signal that asks every rank to stop now, or None to go on. Call it once per
        step on every rank: with ``agree``, it answers what the ranks had received by the
        previous call."""
        received = self._received
        if received and not self._announced:
            self._announced = True
            logger.warning(f"Received {signal.Signals(received).name}: stopping at a step end")
        if not self._agree:
            return signal.Signals(received) if received else None
        agreed = self._finish_pending()
        flag = torch.tensor([received], dtype=torch.int64)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return signal.Signals(agreed) if agreed else None

    def _finish_pending(self) -> int:
        if self._pending is None:
            return 0
        (work, flag), self._pending = self._pending, None
        work.wait()
        return int(flag.item())

    def close(self) -> None:
        """Wait for the reduce in flight (no collective may outlive the run), then put back
        the handlers that were there before."""
        self._finish_pending()
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)


@dataclass(frozen=True)
class Preempted:
    """Why and where a run stopped early, and the checkpoint it saved (None: checkpointing
    is off)."""

    signal: signal.Signals
    step: int
    checkpoint: str | None
    unsaved_because: str = "checkpointing is off (--checkpoint.enable)"
    """Why nothing was saved, where ``checkpoint`` is None."""

    def message(self) -> str:
        if self.checkpoint is None:
            return (
                f"Preempted by {self.signal.name} after step {self.step}: nothing was saved "
                f"({self.unsaved_because}), a new run starts from scratch"
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
    if can_save(checkpointer, step):
        checkpointer.finish_pending()
        preempted = Preempted(signum, step, str(checkpointer.folder / f"step-{step}"))
    else:
        preempted = Preempted(signum, step, None, _unsaved_because(checkpointer))
    logger.warning(preempted.message())
    return preempted


def _unsaved_because(checkpointer) -> str:
    config = checkpointer.config if checkpointer is not None else None
    if config is not None and config.enable:
        if config.load_only:
            return "--checkpoint.load_only"
        if local_tensor.is_simulating():
            return "COMM_MODE=local_tensor never saves checkpoints"
    return Preempted.unsaved_because

"""``<dump_folder>/events.jsonl``: what happened to a run besides its steps, one JSON object per
line, appended by rank 0 across restarts and requeues: ``start`` (the step it starts from, the
torchrun restart count, Slurm's requeue count), ``checkpoint`` (step, seconds the save held the
loop), ``preempt`` (signal, step) and ``end`` (step, ``finished`` or ``preempted``). The run
report (``torchtitan.tools.report``) reads it beside ``metrics.jsonl``."""

import json
import os
import time
from pathlib import Path

from torchtitan.tools.logging import logger

EARLIER_RUNS = "earlier_runs"
# What a run's report is made of, set aside together when a new run starts in the folder.
RUN_RECORD_FILES = (
    "events.jsonl",
    "metrics.jsonl",
    "metrics_rank*.jsonl",
    "report.png",
    "report.txt",
)


class RunEvents:
    """Appends events to ``events.jsonl`` (a no-op on ranks other than the writing one)."""

    def __init__(self, dump_folder: str | Path, *, enabled: bool):
        self.path = Path(dump_folder) / "events.jsonl" if enabled else None

    def write(self, event: str, **fields: object) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"event": event, "time": time.time(), **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    @staticmethod
    def is_new_run(first_step: int) -> bool:
        """A start from step 0 that is not torchrun's restart or Slurm's requeue of this run
        (those continue it, even before its first checkpoint)."""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        requeue = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        return first_step == 0 and restart == 0 and requeue == 0

    def set_aside_earlier_run(self) -> Path | None:
        """Move an earlier run's records out of the way of a new run in the same dump folder
        (its metrics would read as this run's restarts): to
        ``<dump>/earlier_runs/<its first start>/``, renamed, never overwritten. Returns the
        folder, or None when there was nothing (or on ranks that do not write)."""
        if self.path is None:
            return None
        folder = self.path.parent
        found = sorted({p for pattern in RUN_RECORD_FILES for p in folder.glob(pattern)})
        if not found:
            return None
        target = (
            folder / EARLIER_RUNS / time.strftime("%Y%m%d-%H%M%S", time.localtime(_began(found)))
        )
        n = 1
        while target.exists():
            n += 1
            target = target.with_name(f"{target.name.split('~')[0]}~{n}")
        target.mkdir(parents=True)
        for path in found:
            path.rename(target / path.name)
        return target

    def start(self, step: int, world_size: int) -> None:
        """Record a start from ``step``; a new run first sets an earlier one aside."""
        if self.is_new_run(step) and (moved := self.set_aside_earlier_run()) is not None:
            logger.info(
                f"A new run in {moved.parent.parent}: the earlier run's metrics, events and "
                f"report are now in {moved}"
            )
        self.write(
            "start",
            step=step,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            requeue=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            world_size=world_size,
        )


def _began(files: list[Path]) -> float:
    """When the run these files record started: its first ``start`` event, else the oldest
    file's modification time."""
    events = next((p for p in files if p.name == "events.jsonl"), None)
    if events is not None:
        try:
            with events.open() as f:
                first = json.loads(f.readline())
            if first.get("event") == "start":
                return float(first["time"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return min(p.stat().st_mtime for p in files)

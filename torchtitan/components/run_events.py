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
from torchtitan.tools.report import read_jsonl

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

    def __init__(self, dump_folder: str | Path, *, enabled: bool, config_file: str | None = None):
        self.path = Path(dump_folder) / "events.jsonl" if enabled else None
        self.config_file = config_file
        """The resolved config's file in the dump folder (``--job.save_config_file``): set
        aside with an earlier run's records."""

    def write(self, event: str, **fields: object) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"event": event, "time": time.time(), **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def is_new_run(self, resumed: bool) -> bool:
        """A start that does not continue this run: not ``resumed`` from a checkpoint of its
        own folder (a fork of another run starts a run), and not a later attempt. Under the
        launcher a run has one id on every attempt (``TITAN_RUN_ID``): new when no start event
        carries it (also when an earlier attempt died before its first step). Without one, or
        on Slurm's requeue (a new id for the same job), torchrun's restart and Slurm's requeue
        counts say that it continues, even before its first checkpoint."""
        if resumed or int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0:
            return False
        run = os.environ.get("TITAN_RUN_ID")
        if run is None:
            return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        return not any(e.get("run") == run for e in self._events("start"))

    def _events(self, kind: str) -> list[dict]:
        if self.path is None or not self.path.is_file():
            return []
        return [e for e in read_jsonl(self.path)[0] if e.get("event") == kind]

    def set_aside_earlier_run(self) -> Path | None:
        """Move an earlier run's records out of the way of a new run in the same dump folder
        (its metrics would read as this run's restarts): to
        ``<dump>/earlier_runs/<its first start>/``, renamed, never overwritten. Returns the
        folder, or None when there was nothing (or on ranks that do not write)."""
        if self.path is None:
            return None
        folder = self.path.parent
        found = sorted({p for pattern in RUN_RECORD_FILES for p in folder.glob(pattern)})
        if not found:  # a config alone is an attempt of this run that died before its start
            return None
        starts = self._events("start")
        # The earlier run's config by the name its starts recorded, and by this run's.
        names = {self.config_file, *(e.get("config") for e in starts)}
        found += [p for name in names if (p := _inside(folder, name)) is not None]
        found = list({p.resolve(): p for p in found}.values())  # a name may be a record's
        # When the earlier run began: its first start, else its oldest file.
        began = starts[0].get("time") if starts else None
        began = began or min(p.stat().st_mtime for p in found)
        target = folder / EARLIER_RUNS / time.strftime("%Y%m%d-%H%M%S", time.localtime(began))
        n = 1
        while target.exists():
            n += 1
            target = target.with_name(f"{target.name.split('~')[0]}~{n}")
        target.mkdir(parents=True)
        for path in found:  # where it was in the folder (a config may sit in a subfolder)
            moved = target / os.path.normpath(path.relative_to(folder))
            moved.parent.mkdir(parents=True, exist_ok=True)
            path.rename(moved)
        return target

    def set_aside_if_new(self, *, resumed: bool) -> None:
        """A new run sets an earlier run's records aside (before it writes its own config
        into the folder and before any rank's first metrics record)."""
        if self.is_new_run(resumed) and (moved := self.set_aside_earlier_run()) is not None:
            logger.info(
                f"A new run in {moved.parent.parent}: the earlier run's metrics, events, "
                f"config and report are now in {moved}"
            )

    def start(self, step: int, world_size: int) -> None:
        """Record a start from ``step`` (after :meth:`set_aside_if_new`)."""
        self.write(
            "start",
            step=step,
            run=os.environ.get("TITAN_RUN_ID"),
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            requeue=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            world_size=world_size,
            config=self.config_file,
        )


def _inside(folder: Path, name: object) -> Path | None:
    """``folder / name`` when it is a file inside ``folder`` (an absolute
    ``--job.save_config_file`` elsewhere is not the run's to move)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        return None
    path = folder / name
    if not path.is_file() or folder.resolve() not in path.resolve().parents:
        return None
    return path

"""``<dump_folder>/events.jsonl``: what happened to a run besides its steps, one JSON object per
line, appended by rank 0 across restarts and requeues: ``start`` (the step it starts from, the
torchrun restart count, Slurm's requeue count), ``checkpoint`` (step, seconds the save held the
loop), ``preempt`` (signal, step) and ``end`` (step, ``finished`` or ``preempted``). The run
report (``torchtitan.tools.report``) reads it beside ``metrics.jsonl``."""

import json
import os
import time
from pathlib import Path


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

    def start(self, step: int, world_size: int) -> None:
        self.write(
            "start",
            step=step,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            requeue=int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            world_size=world_size,
        )

"""Hang watchdog: a step that outlives its timeout leaves evidence and ends the process.

NCCL dumps its flight recorder by itself when a collective times out (``init_distributed``
points it at ``<dump>/comm_traces/``). Gloo has no such dump and a rank stuck in a collective
can wait for a long time, so this thread watches the training loop: when one step takes
longer than its timeout it writes, into ``<dump>/comm_traces/``,

- ``rank<r>_flight_recorder.json``: the flight recorder's collectives of this rank (the
  pending one is the last entry whose state is not ``completed``),
- ``rank<r>_stacks.txt``: the Python stack of every thread,

then exits the process with ``EXIT_CODE``, so the launcher tears the job down.
"""

import faulthandler
import json
import os
import threading
import time
from pathlib import Path

from torchtitan.config.observability import Comm
from torchtitan.failure_records import HANG_EXIT_CODE, note_hung
from torchtitan.tools.logging import logger

EXIT_CODE = HANG_EXIT_CODE
"""Exit status of a rank the watchdog ended (124, as ``timeout(1)`` uses)."""
DUMP_GRACE_SECONDS = 2.0
"""How long a rank that dumped waits before it exits, for the others to dump too."""


def dump_flight_recorder(path: Path, about: dict | None = None) -> int:
    """Write this rank's flight-recorder entries as JSON, with ``about`` (this run, rank and
    step) and the members of each of its process groups under ``"titan"``
    (``tools/hang_report.py`` reads them together); return how many entries were recorded."""
    import torch._C._distributed_c10d as c10d

    trace = json.loads(c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    # NCCL keeps its own recorder (gloo's is the one above): merge its collectives in.
    nccl = getattr(c10d, "_dump_nccl_trace_json", None)
    if nccl is not None:
        try:
            extra = json.loads(nccl(True, False))  # (includeCollectives, onlyActive)
        except Exception:  # no NCCL in this build or process
            extra = {}
        trace["entries"] = list(trace.get("entries") or []) + list(extra.get("entries") or [])
        # Each backend counts a group's collectives on its own (a CUDA group is gloo + NCCL).
        trace["nccl_pg_status"] = extra.get("pg_status") or {}
        if extra.get("pg_config"):
            trace["pg_config"] = {**(trace.get("pg_config") or {}), **extra["pg_config"]}
    trace["titan"] = dict(about or {}) | {"groups": _process_groups()}
    path.write_text(json.dumps(trace, indent=1, default=str))
    return len(trace.get("entries", []))


def _process_groups() -> dict[str, list[int]]:
    """Each process group of this rank by the name the flight recorder gives it, with its
    global ranks (gloo's dump has no membership; NCCL's ``pg_config`` has)."""
    try:
        from torch.distributed.distributed_c10d import _world

        return {
            str(name): sorted(_world.pg_group_ranks[pg]) for pg, name in _world.pg_names.items()
        }
    except Exception:  # private state: the report then infers members from the entries
        return {}


class StepWatchdog:
    """``start(step, timeout)`` before a step, ``stop()`` after; a step over time ends the run."""

    def __init__(self, dump_folder: str, rank: int):
        self.folder = Path(dump_folder) / "comm_traces"
        self.rank = rank
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._step = 0
        self._timeout = 0.0
        self._closed = threading.Event()
        self._changed = threading.Event()  # a deadline set, or closing: wake the thread
        self._collectives_switched = False  # NCCL's timeout set to the train timeout
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def start(self, step: int, timeout_seconds: float) -> None:
        with self._lock:
            self._step, self._timeout = step, timeout_seconds
            self._deadline = time.monotonic() + timeout_seconds
        self._changed.set()

    def arm(self, step: int, trained: int, comm: Comm, *, nccl: bool) -> None:
        """Watch ``step``: with ``--comm.init_timeout_seconds`` until this process has
        ``trained`` a step (the first carries compilation and the first collectives; a skipped
        step trains nothing), then with ``--comm.train_timeout_seconds``. ``nccl``: switch
        NCCL's collectives to the train timeout then too (NCCL dumps its flight recorder when
        one times out; on gloo this watchdog enforces the timeout, as a gloo timeout error
        would leave no dump)."""
        if trained >= 1 and nccl and not self._collectives_switched:
            from torchtitan.distributed.utils import set_pg_timeouts

            set_pg_timeouts(comm.train_timeout_seconds)
            self._collectives_switched = True
        timeout = comm.init_timeout_seconds if trained == 0 else comm.train_timeout_seconds
        self.start(step, timeout)

    def stop(self) -> None:
        with self._lock:
            self._deadline = None

    def close(self) -> None:
        self._closed.set()
        self._changed.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        """Wake at the deadline itself: the ranks' watchdogs then fire within the skew of their
        steps' starts, which the last step's collectives keep small."""
        while not self._closed.is_set():
            with self._lock:
                deadline = self._deadline
                step, timeout = self._step, self._timeout
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._fire(step, timeout)
            # (bounded: Event.wait overflows past threading.TIMEOUT_MAX)
            self._changed.wait(None if deadline is None else min(deadline - now, 3600.0))
            self._changed.clear()

    def _fire(self, step: int, timeout: float) -> None:
        try:
            self._dump(step, timeout)
            # The other ranks' watchdogs are due about now: leaving at once would break their
            # collectives (they would stop as having lost a peer, without a dump).
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                time.sleep(DUMP_GRACE_SECONDS)
        finally:  # a dump that failed (a full disk) must not leave the rank hanging
            os._exit(EXIT_CODE)

    def _dump(self, step: int, timeout: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}_flight_recorder.json"
        stacks = self.folder / f"rank{self.rank}_stacks.txt"
        about = {
            "run": os.environ.get("TITAN_RUN_ID"),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "rank": self.rank,
            "step": step,
            "time": time.time(),
        }
        try:
            entries = dump_flight_recorder(trace, about)
            recorded = f"{entries} flight-recorder entries in {trace}"
        except Exception as e:  # the stack dump below still gets written
            recorded = f"no flight-recorder dump ({type(e).__name__}: {e})"
        with stacks.open("w") as f:
            # Which thread is the main one (the training loop): tools/hang_report.py reads it.
            f.write(f"# main thread 0x{threading.main_thread().ident:016x}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        logger.error(
            f"Step {step} on rank {self.rank} did not finish within {timeout:g} s "
            f"(--comm.train_timeout_seconds / init_timeout_seconds for step 1): a rank is "
            f"probably stuck in a collective or its data. Wrote {recorded} and all thread "
            f"stacks to {stacks}; exiting with {EXIT_CODE}"
        )
        for handler in logger.handlers:
            handler.flush()
        note_hung(step, str(self.folder))

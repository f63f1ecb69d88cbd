"""What a rank leaves for its launcher (``launcher.py``) when it stops: one JSON record per rank
in a folder the launcher makes (``FAILURE_DIR_ENV``), read when the ranks fail or end.

- a **refusal** (bad input, exit 2; a non-finite step, 3): the launcher prints its one line
  instead of torchrun's report, exits with its code and does not restart;
- a **crash** (any other exception, exit 1): its first line, traceback and log file, so that
  the launcher names it before the ranks that only lost it, whatever order torchrun saw them
  end in, and shows its traceback where ``LOG_RANK`` hid that rank's console;
- a **preemption** (the step saved; exit 0 under the launcher) and a **hang** (the watchdog
  ended the rank, 124; its dumps read together by ``tools/hang_report.py``).

In a job of several nodes, refusals and crashes are also published in the job's store
(``job_store.py``): a rank of another node that loses its peer copies the record into its own
launcher's folder (:func:`a_rank_said_why`), so that every node names the same cause.

No torch import here: the launcher imports this module before torch.
"""

import json
import os
import socket
import time
import traceback
from pathlib import Path

from torchtitan import job_store

FAILURE_DIR_ENV = "TITAN_FAILURE_DIR"
ATTEMPT_START_ENV = "TITAN_ATTEMPT_START"  # when the launcher started this attempt's ranks
PREEMPTED_EXIT_CODE = 75  # components/preemption.EXIT_CODE (this module imports no torch)
LOST_PEER_EXIT_CODE = 4  # a rank whose collective lost another rank (train.py)
HANG_EXIT_CODE = 124  # a rank its hang watchdog ended (tools/watchdog.py)
# What a collective or the store raises on a rank whose peer died: gloo, the peer's socket
# closed or reset; NCCL, ncclRemoteError ("remote process exited or there was a network error");
# the store, "Failed to recv, got 0 bytes. Connection was likely closed. ...".
# Read by distributed/utils.lost_peer, and by the launcher's filter of gloo's C++ log lines.
LOST_PEER_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "Connection was likely closed",  # the store's, when the rank hosting it went away
)
# A crash's traceback is kept to its first and last lines (the raise is at the end).
_TRACEBACK_HEAD, _TRACEBACK_TAIL = 40, 160


def refuse(code: int, message: str) -> bool:
    """Record this rank's reason to stop (``code`` 2: bad input, 3: non-finite step) for the
    launcher, and in the job's store for the launchers of other nodes. Returns whether a
    launcher will print it (else log it yourself)."""
    record = {"code": code, "message": message, "time": time.time()}
    if not write_record("rank", record):
        return False
    job_store.publish("refusal", {"rank": _rank(), **record})
    return True


def note_crash(error: BaseException, log_file: str | None) -> bool:
    """Record that this rank ends with ``error`` (an exception it did not expect; its traceback
    is also in ``log_file``), before it propagates: a rank that loses this one then finds why
    (:func:`a_rank_said_why`), and the launcher names it first. Returns whether a launcher
    will read it; never raises (the caller's exception is the story)."""
    try:
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else ""
        if len(first_line) > 500:
            first_line = first_line[:500] + "..."
        lines = "".join(traceback.format_exception(error)).rstrip().splitlines()
        if len(lines) > _TRACEBACK_HEAD + _TRACEBACK_TAIL:
            cut = len(lines) - _TRACEBACK_HEAD - _TRACEBACK_TAIL
            where = f"; all of it in {log_file}" if log_file else ""
            marker = f"... {cut} lines cut{where} ..."
            lines = lines[:_TRACEBACK_HEAD] + [marker] + lines[-_TRACEBACK_TAIL:]
        name = type(error).__name__
        record = {
            "error": f"{name}: {first_line}" if first_line else name,
            "traceback": "\n".join(lines),
            "log": str(log_file) if log_file else None,
            "host": socket.gethostname(),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "time": time.time(),
        }
        if not write_record("crash-rank", record):
            return False
        shared = {k: v for k, v in record.items() if k != "traceback"}  # others print a line
        job_store.publish("crash", {"rank": _rank(), **shared})
        return True
    except Exception:  # a record that cannot be made (a full disk, an unprintable error)
        return False


def a_rank_said_why() -> bool:
    """Whether a rank of this attempt has said why it stopped (refused, stopped on a non-finite
    step, raised): a rank that then loses a peer has nothing to add to what the launcher
    prints. Another node's rank said it in the job's store; found there, it is copied to this
    node's folder so that this launcher names it too. That takes a rank that notices the lost
    peer while the store is there (the launcher's ``_LINGER_S``): gloo's at once."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return False
    if refusals(folder) or crashes(folder):
        return True
    found = job_store.published()
    if (refusal := found.get("refusal")) is not None:
        return write_record("rank", refusal, rank=refusal["rank"])
    crash = found.get("crash")
    started = float(os.environ.get(ATTEMPT_START_ENV, "0"))
    named = bool(os.environ.get(job_store.ATTEMPT_ENV))  # then the key is this attempt's alone
    if crash is not None and (named or crash["time"] >= started - 1):  # not an earlier one's
        # Timed by this node's clock, when it arrived here (before any crash here: see above):
        # the launcher orders crashes and kills by time, and another node's clock may differ.
        copy = {**crash, "copied_by": _rank(), "time": time.time()}
        return write_record("crash-rank", copy, rank=crash["rank"])
    return False


def note_preempted(signal_name: str, step: int, checkpoint: str | None) -> bool:
    """Record that this rank stopped for a preemption signal after ``step`` (having saved
    ``checkpoint``). Returns whether a launcher will report it; this rank then exits 0, so that
    torchrun does not count it as a failure to restart from."""
    record = {"signal": signal_name, "step": step, "checkpoint": checkpoint}
    return write_record("preempted-rank", record)


def note_hung(step: int, traces: str) -> bool:
    """Record that this rank's hang watchdog ended it in ``step``, having written its dumps to
    ``traces``: the launcher reads them together (``tools/hang_report.py``)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = {"step": step, "traces": traces, "attempt": attempt, "time": time.time()}
    return write_record("hung-rank", record)


def write_record(name: str, record: dict, *, rank: int | None = None) -> bool:
    """``<folder>/<name><rank>.json`` (this rank's unless ``rank`` is given), whole or not at
    all; False without a launcher."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return False
    rank = _rank() if rank is None else rank
    path = Path(folder) / f"{name}{rank}.json"
    partial = path.with_suffix(f".tmp{_rank()}")  # ranks of this node may copy one record
    partial.write_text(json.dumps({**record, "rank": rank}))
    partial.replace(path)  # the launcher never reads half a record
    return True


def read_records(folder: str | Path, name: str) -> list[dict]:
    records = []
    for path in Path(folder).glob(f"{name}*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def refusals(folder: str | Path) -> list[dict]:
    """Every rank's refusal in ``folder``, earliest first (empty if no rank refused)."""
    return sorted(read_records(folder, "rank"), key=lambda r: (r["time"], r["rank"]))


def crashes(folder: str | Path) -> list[dict]:
    """The crashes in ``folder``, earliest first: this node's ranks' own, and another node's
    copied by a rank here (``copied_by``)."""
    return sorted(read_records(folder, "crash-rank"), key=lambda r: (r["time"], r["rank"]))


def clear_crashes(folder: str | Path) -> None:
    """Forget the crashes of an earlier attempt (the ranks are about to start again)."""
    for path in Path(folder).glob("crash-rank*.json"):
        path.unlink(missing_ok=True)


def preempted(folder: str | Path) -> dict | None:
    """Rank 0's (or the lowest rank's) preemption record, if the ranks were preempted."""
    records = read_records(folder, "preempted-rank")
    return min(records, key=lambda r: r["rank"]) if records else None


def format_refusal(record: dict, *, also: list[int] | tuple[int, ...] = ()) -> str:
    """``[rank1] error: <message>``, naming the other ranks that refused alike."""
    plural = "s" if len(also) > 1 else ""
    others = f" (rank{plural} {', '.join(map(str, also))} too)" if also else ""
    return f"[rank{record['rank']}] error: {record['message']}{others}"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))

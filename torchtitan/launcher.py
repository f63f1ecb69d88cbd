"""``python -m torchtitan.launcher [torchrun flags] -m torchtitan.train ...``: torchrun, with
refusals reported as one line.

A rank that refuses its input (exit code 2) or stops on a non-finite step (3) writes its one
line to a file in a folder this launcher makes (``TITAN_FAILURE_DIR``) instead of the console;
in a job of several nodes also to torchrun's store, where a rank of another node that loses it
finds it and copies it to its own launcher's folder, so every node prints that line.
When the job fails, the launcher prints the line of the rank that failed first, prefixed by the
rank, whatever ``LOG_RANK`` shows, and exits with that rank's code. torchrun's own report (a
``ChildFailedError`` traceback naming only an exit code) is printed only for crashes, kills
and unexpected exceptions, whose traceback is what a user needs, followed by one line that
names the failure that started it before the ranks that only followed (a rank whose collective
lost the dead one exits with ``LOST_PEER_EXIT_CODE`` after one line of its own, written to its
log file only when a rank had refused; torchrun ends the others). When the hang watchdog ended
ranks, the launcher reads their flight-recorder dumps together and says who waited for whom
(``tools/hang_report.py``). ``run_train.sh`` and ``multinode_trainer.slurm`` start ranks
through it.

Two more things a long job needs:

- **Preemption**: SIGTERM or SIGUSR1 (to this process, or to the ranks as Slurm sends it)
  makes the ranks finish their step and save a checkpoint (``components/preemption.py``); the
  launcher then exits with ``preemption.EXIT_CODE`` (75) so a job script can requeue. torchrun
  is told to pass SIGUSR1 on (``--signals_to_handle``) and, on torch >= 2.13, to wait up to
  ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (600 here by default; 30, fixed, on torch 2.11)
  for the ranks to save before it kills them.
- **Restarts** (``--max-restarts N``, ``MAX_RESTARTS`` in the scripts): when a rank dies, torchrun
  restarts every rank and they resume from the last complete checkpoint. Each restart is
  printed with its cause; a refusal (bad input, a non-finite step) is not retried, since it would
  only fail again.

The rank side is :func:`refuse`. This module imports torch only inside :func:`main` (and
``job_store.py``, which ranks call, inside its functions).
"""

import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from torchtitan import job_store
from torchtitan.tools import hang_report
from torchtitan.tools.hang_report import ranks_text

FAILURE_DIR_ENV = "TITAN_FAILURE_DIR"
PREEMPTED_EXIT_CODE = 75  # components/preemption.EXIT_CODE (this module imports no torch)
LOST_PEER_EXIT_CODE = 4  # a rank whose collective lost another rank (train.py)
HANG_EXIT_CODE = 124  # a rank its hang watchdog ended (tools/watchdog.py)
# What a collective or the store raises on a rank whose peer died: gloo, the peer's socket
# closed or reset; NCCL, ncclRemoteError ("remote process exited or there was a network error").
# Read by distributed/utils.lost_peer, and by _Dropping in gloo's C++ log lines.
LOST_PEER_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
)
_SIGTERM = 15
_FINAL_HANG: list[str] = []  # the last attempt's hang report, for after torchrun's
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# After a refusal in a job of several nodes, how long the agent waits before it ends (and with
# it the store, when it hosts it): the other nodes' ranks learn of the refusal when the refusing
# rank's process exits, and read it from the store in the meantime (milliseconds, unloaded).
_LINGER_S = 5.0


def refuse(code: int, message: str) -> bool:
    """Record this rank's reason to stop (``code`` 2: bad input, 3: non-finite step) for the
    launcher, and in the job's store for the launchers of other nodes (see
    :func:`a_rank_refused`). Returns whether a launcher will print it (else log it yourself)."""
    record = {"code": code, "message": message, "time": time.time()}
    if not _write_record("rank", record):
        return False
    job_store.publish({"rank": _rank(), **record})
    return True


def a_rank_refused() -> bool:
    """Whether a rank of this job has recorded its refusal, or a non-finite step: a rank that
    then loses a peer in a collective has nothing to add to the line the launcher prints. Not
    which rank: a crash of another rank at the same moment is then told only by torchrun's
    exit codes.

    This node's ranks are in the launcher's folder. A rank on another node published its
    record in the job's store (``job_store.py``); found there, it is copied to this node's
    folder, so that this node's launcher prints the same line, exits with its code and does not
    restart the ranks (the other node would not come back to meet them). That takes a rank
    that notices the lost peer while the store is there (``_LINGER_S``): gloo's at once."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return False
    if refusals(folder):
        return True
    record = job_store.published()
    if record is None:
        return False
    return _write_record("rank", record, rank=record["rank"])


def note_preempted(signal_name: str, step: int, checkpoint: str | None) -> bool:
    """Record that this rank stopped for a preemption signal after ``step`` (having saved
    ``checkpoint``). Returns whether a launcher will report it; this rank then exits 0, so that
    torchrun does not count it as a failure to restart from."""
    record = {"signal": signal_name, "step": step, "checkpoint": checkpoint}
    return _write_record("preempted-rank", record)


def note_hung(step: int, traces: str) -> bool:
    """Record that this rank's hang watchdog ended it in ``step``, having written its dumps to
    ``traces``: the launcher reads them together (``tools/hang_report.py``)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = {"step": step, "traces": traces, "attempt": attempt, "time": time.time()}
    return _write_record("hung-rank", record)


def hang_lines(folder: str | Path, world_size: int | None) -> list[str]:
    """Who the ranks waited for, when the hang watchdog ended some (their records in
    ``folder``): ``[launcher] the hang: ...`` lines; the records are then removed, so that a
    restarted attempt's hang is read alone. (Its caller keeps an error here from hiding the
    failure it reports on.)"""
    records = _read_records(folder, "hung-rank")
    for path in Path(folder).glob("hung-rank*.json"):
        path.unlink(missing_ok=True)
    if not records:
        return []
    attempt = max(r.get("attempt", 0) for r in records)
    run = os.environ.get("TITAN_RUN_ID")
    dumps: dict = {}
    for traces in sorted({r["traces"] for r in records}):
        dumps |= hang_report.load(traces, run=run, attempt=attempt)
    return [f"[launcher] the hang: {line}" for line in hang_report.diagnose(dumps, world_size)]


def _write_record(name: str, record: dict, *, rank: int | None = None) -> bool:
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


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _preempted(folder: str | Path) -> dict | None:
    """Rank 0's (or the lowest rank's) preemption record, if the ranks were preempted."""
    records = _read_records(folder, "preempted-rank")
    return min(records, key=lambda r: r["rank"]) if records else None


def _preemption_line(record: dict) -> str:
    saved = record["checkpoint"]
    where = f"saved {saved}" if saved else "nothing saved (checkpointing is off)"
    return (
        f"preempted by {record['signal']} after step {record['step']}: {where}; "
        f"exit code {PREEMPTED_EXIT_CODE}, the same command resumes"
    )


def refusals(folder: str | Path) -> list[dict]:
    """Every rank's record in ``folder``, earliest first (empty if no rank refused)."""
    return sorted(_read_records(folder, "rank"), key=lambda r: (r["time"], r["rank"]))


def _read_records(folder: str | Path, name: str) -> list[dict]:
    records = []
    for path in Path(folder).glob(f"{name}*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def format_refusal(record: dict, *, also: Sequence[int] = ()) -> str:
    """``[rank1] error: <message>``, naming the other ranks that refused alike."""
    plural = "s" if len(also) > 1 else ""
    others = f" (rank{plural} {', '.join(map(str, also))} too)" if also else ""
    return f"[rank{record['rank']}] error: {record['message']}{others}"


def main(argv: Sequence[str] | None = None) -> int:
    # This process's own C++ warnings are pages of stack frames for one event a user needs no
    # more than a line about: its agent's store connection failing when the launcher of the
    # node that hosted the rendezvous ended first (below). Read when torch loads; the ranks
    # keep the user's level.
    cpp_log_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    if cpp_log_level is None:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousError
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if cpp_log_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]

    # torchrun's own log lines (OMP_NUM_THREADS defaults, closing signals, "failed (exitcode:
    # 2)") are noise to a user; a failure is reported below, in full when it is a crash.
    for name in ("torch.distributed.run", "torch.distributed.elastic"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # The agent's logger has a level of its own; of its lines only this one is noise (the
    # launcher names the signal), the rest (shutdown trouble, rendezvous) stay.
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: "death signal, shutting down workers" not in str(record.msg)
    )
    # torchrun copies the ranks' lines to these streams (TailLog); drop what means nothing.
    sys.stdout, sys.stderr = _Dropping(sys.stdout), _Dropping(sys.stderr)
    folder = tempfile.mkdtemp(prefix="titan-failures-")
    os.environ[FAILURE_DIR_ENV] = folder
    os.environ["TITAN_LAUNCHER"] = "1"  # torchrun prefixes the ranks' lines itself
    os.environ.setdefault("TITAN_RUN_ID", time.strftime("%Y%m%d-%H%M%S"))  # one log folder
    os.environ.setdefault("TITAN_TERMINAL", "1" if sys.stderr.isatty() else "0")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")  # torch >= 2.13 reads it
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.split("=")[0] in ("--signals_to_handle", "--signals-to-handle") for a in args):
        args = ["--signals_to_handle", SIGNALS_TO_HANDLE, *args]
    if _max_restarts(args) > 0:
        # The ranks' store is the agent's by default, shared by every attempt, and the keys of
        # the process group's first attempt are still in it: restarted gloo ranks can read
        # their dead predecessors' addresses and hang (pytorch/pytorch#135712). Without
        # sharing, each attempt's rank 0 hosts a fresh store on a fresh port.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    started = _report_restarts(folder)
    try:
        parsed = torchrun.parse_args(args)
        os.environ.pop(job_store.JOB_STORE_ENV, None)  # not another launcher's
        if parsed.rdzv_backend == "c10d" and parsed.rdzv_endpoint:
            host, port = parse_rendezvous_endpoint(parsed.rdzv_endpoint, default_port=29400)
            if port:  # 0: a free port torchrun picks, on one node (run_train.sh)
                os.environ[job_store.JOB_STORE_ENV] = f"{host}:{port}"
        torchrun.run(parsed)
        if (record := _preempted(folder)) is not None:
            print(_preemption_line(record), file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        return 0
    except SignalException as e:
        # This process was signalled: torchrun passed the signal to the ranks and waited.
        if (record := _preempted(folder)) is not None:
            print(_preemption_line(record), file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        print(
            f"[launcher] stopped by {e.sigval.name}: the ranks stopped without saving (SIGTERM "
            "or SIGUSR1 to this process saves the current step first)",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        records = refusals(folder)
        if not records:
            # A rank ended by its watchdog, or stopped on losing a peer, said why in its own
            # line: torchrun's report (exit codes, no traceback) adds nothing then.
            if not all(
                f.exitcode in (HANG_EXIT_CODE, LOST_PEER_EXIT_CODE) for f in e.failures.values()
            ):
                print(e.format_msg(), file=sys.stderr)
            # torchrun's "Root Cause" is the earliest failure it saw, and a rank that lost
            # contact with a dead one can be seen first; this line orders them by what they say.
            print(f"[launcher] the job failed: {_causes(e.failures)}", file=sys.stderr)
            for line in _FINAL_HANG:
                print(line, file=sys.stderr)
            return 1
        return _print_refusal(records)
    except RendezvousError as e:
        # Several nodes. Once the ranks run, this agent keeps watching the rendezvous, and the
        # node hosting it can end first (its ranks failed there; this agent then stops its
        # own): a refusal found in the job's store is the reason to print. Before, the
        # rendezvous could not be reached or made at all.
        if records := refusals(folder):
            return _print_refusal(records)
        cause = (str(e.__cause__ or e).strip().splitlines() or [type(e).__name__])[0]
        if started.is_set() and isinstance(e, RendezvousConnectionError):
            print(
                f"[launcher] this node lost the job's rendezvous ({cause}): the node hosting it "
                "ended first, and its output says why; this node's ranks were stopped",
                file=sys.stderr,
            )
        else:
            print(f"[launcher] the rendezvous failed: {type(e).__name__}: {cause}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _print_refusal(records: list[dict]) -> int:
    """The first refusal's line, naming the ranks that refused alike; its exit code."""
    first, others = records[0], records[1:]
    same = sorted(r["rank"] for r in others if r["message"] == first["message"])
    print(format_refusal(first, also=same), file=sys.stderr)
    return int(first["code"])


def _max_restarts(args: Sequence[str]) -> int:
    """torchrun's ``--max-restarts`` (or ``--max_restarts``) in ``args``; 0 when absent."""
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in ("--max-restarts", "--max_restarts"):
            value = value or (args[i + 1] if i + 1 < len(args) else "0")
            return int(value) if value.isdigit() else 0
    return 0


def _report_restarts(folder: str) -> threading.Event:
    """Print each restart of the ranks with its cause, and do not restart after a refusal.
    Returns an event set once the agent has watched its ranks.

    torchrun's agent decides restarts in its monitoring loop and logs them without the cause;
    the failure is in the ``RunResult`` that ``_monitor_workers`` (the method an agent
    implements) returns, so this wraps that method of the local agent."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    started = threading.Event()
    monitor = getattr(
        LocalElasticAgent._monitor_workers, "wrapped", LocalElasticAgent._monitor_workers
    )

    def monitor_and_report(agent, worker_group):
        started.set()
        result = monitor(agent, worker_group)
        if not result.is_failed():
            return result
        left = getattr(agent, "_remaining_restarts", 0)
        try:
            workers = worker_group.workers
            hang = hang_lines(folder, workers[0].world_size if workers else None)
        except Exception as e:  # the report must never hide the failure it reports on
            hang = [f"[launcher] the hang: could not read the dumps ({type(e).__name__}: {e})"]
        if refusals(folder):
            agent._remaining_restarts = 0  # the launcher prints the refusal
            workers = worker_group.workers
            if workers and workers[0].world_size > len(workers):
                time.sleep(_LINGER_S)  # other nodes: see _LINGER_S
        elif left > 0:
            spec = worker_group.spec
            done = spec.max_restarts - left + 1
            causes = _causes(result.failures)
            print(
                f"[launcher] restart {done} of {spec.max_restarts}: {causes}; restarting every "
                f"rank from the last complete checkpoint",
                *hang,
                sep="\n",
                file=sys.stderr,
                flush=True,
            )
        else:
            _FINAL_HANG[:] = hang  # printed after torchrun's report of the failure
        return result

    monitor_and_report.wrapped = monitor
    LocalElasticAgent._monitor_workers = monitor_and_report
    return started


def _causes(failures: dict) -> str:
    """The ranks' failures, those that started it first: ``rank 1 was killed by SIGKILL (then
    rank 0 lost contact and stopped)``. Following are a rank that stopped because a collective
    lost a peer (``LOST_PEER_EXIT_CODE``), one ended by SIGTERM, and one that ended after the
    first failures torchrun saw (its ``timestamp``, in seconds, is later: torchrun stops the
    other ranks then, with SIGTERM and after a while SIGKILL, and a rank hung on a dead peer
    under NCCL ends that way or by its own watchdog). When every failure is of that kind (a
    network fault), they are all listed."""
    earliest = min(f.timestamp for f in failures.values())

    def follows(failure) -> bool:
        late = failure.timestamp > earliest
        return late or failure.exitcode in (LOST_PEER_EXIT_CODE, -_SIGTERM)

    first = {r: f for r, f in failures.items() if not follows(f)} or failures
    lost = [r for r, f in failures.items() if r not in first and f.exitcode == LOST_PEER_EXIT_CODE]
    stopped = [r for r, f in failures.items() if r not in first and r not in lost]
    then = [f"{ranks_text(lost)} lost contact and stopped"] if lost else []
    then += [f"{ranks_text(stopped)} stopped by torchrun"] if stopped else []
    line = "; ".join(_cause(rank, f) for rank, f in sorted(first.items()))
    return line + (f" (then {'; '.join(then)})" if then else "")


def _cause(rank: int, failure) -> str:
    """``rank 1 was killed by SIGKILL`` / ``rank 0 exited with code 124 (the hang watchdog)``."""
    if failure.exitcode < 0:
        return f"rank {rank} was killed by {failure.signal_name()}"
    known = {
        HANG_EXIT_CODE: " (the hang watchdog)",
        1: " (an exception; its traceback is above)",
        LOST_PEER_EXIT_CODE: " (a collective lost another rank)",
    }
    return f"rank {rank} exited with code {failure.exitcode}{known.get(failure.exitcode, '')}"


class _Dropping:
    """A text stream that passes every line except two that mean nothing to a user: torch's
    C++ profiler markers (``USDT: ... profiler_start``), which kineto prints on every profiled
    step, and gloo's C++ log line for a peer that went away (``[E1129 ...
    ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with [.../pair.cc:553] Connection
    closed by peer ...``), whatever the cause: the same words are in the exception the rank
    then reports in one line (exit code ``LOST_PEER_EXIT_CODE``) and keeps, with its
    traceback, in its log file."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        # torchrun writes one line per call, after its "[rank0]:" prefix.
        if "USDT:" in text and "profiler_" in text:
            return len(text)
        if "ProcessGroupGloo.cpp:" in text and any(m in text for m in LOST_PEER_MARKERS):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    # main()'s last line is the user's last: interpreter shutdown can still print "Exception
    # ignored in: ..." from some finalizer (seen once in CI after a preemption line, the object
    # not named), so once everything is flushed the process ends without it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

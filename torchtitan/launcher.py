"""``python -m torchtitan.launcher [torchrun flags] -m torchtitan.train ...``: torchrun, with
each failure told once, by its cause.

The ranks leave records of why they stop in a folder this launcher makes
(``failure_records.py``); in a job of several nodes a refusal or a crash also reaches the
other nodes' launchers through the job's store. When the job fails:

- a rank that refused its input (exit code 2) or stopped on a non-finite step (3): the first
  such rank's one line, prefixed by the rank, whatever ``LOG_RANK`` shows, and its exit code;
- otherwise one line that names the failures that started it before the ranks that only
  followed (``[launcher] the job failed: rank 1 raised ValueError: ... (traceback in
  <log>) (then rank 0 lost contact and stopped)``). A rank's exception is named from its
  record, first even when torchrun saw it end later (killed while exiting), and its
  traceback is printed here when ``LOG_RANK`` hid that rank's console. torchrun's own report
  (a ``ChildFailedError`` naming only exit codes) comes before it for kills and other deaths
  without a record. A rank whose collective lost the dead one exits with
  ``LOST_PEER_EXIT_CODE`` after one line of its own (only in its log file when another rank
  said why it stopped); torchrun ends the others.
- when the hang watchdog ended ranks, their flight-recorder dumps read together: who waited
  for whom (``tools/hang_report.py``).

The ranks' lines carry their global rank on every node (``[rank9]:`` with the scripts'
``--role rank``). ``run_train.sh`` and ``multinode_trainer.slurm`` start ranks through it.

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

This module imports torch only inside :func:`main`.
"""

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
from torchtitan.failure_records import (
    ATTEMPT_START_ENV,
    FAILURE_DIR_ENV,
    HANG_EXIT_CODE,
    LOST_PEER_EXIT_CODE,
    LOST_PEER_MARKERS,
    PREEMPTED_EXIT_CODE,
    clear_crashes,
    crashes,
    format_refusal,
    preempted,
    read_records,
    refusals,
)
from torchtitan.tools import hang_report
from torchtitan.tools.hang_report import ranks_text

_SIGTERM = 15
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# After a refusal or a crash in a job of several nodes, how long the agent waits before it ends
# (and with it the store, when it hosts it): the other nodes' ranks learn of it when the
# failing rank's process exits, and read it from the store in the meantime (milliseconds,
# unloaded).
_LINGER_S = 5.0
_CRASH_GROUPS_SHOWN = 3  # different exceptions named in one line; the rest by their ranks


def hang_lines(folder: str | Path, world_size: int | None) -> list[str]:
    """Who the ranks waited for, when the hang watchdog ended some (their records in
    ``folder``): ``[launcher] the hang: ...`` lines; the records are then removed, so that a
    restarted attempt's hang is read alone. (Its caller keeps an error here from hiding the
    failure it reports on.)"""
    records = read_records(folder, "hung-rank")
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


def _preemption_line(record: dict) -> str:
    saved = record["checkpoint"]
    where = f"saved {saved}" if saved else "nothing saved (checkpointing is off)"
    return (
        f"preempted by {record['signal']} after step {record['step']}: {where}; "
        f"exit code {PREEMPTED_EXIT_CODE}, the same command resumes"
    )


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
    # The ranks' lines carry their global rank: torchrun's default is the local one, the same
    # on every node of a job.
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${role_name}${rank}]:")
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.split("=")[0] in ("--signals_to_handle", "--signals-to-handle") for a in args):
        args = ["--signals_to_handle", SIGNALS_TO_HANDLE, *args]
    try:
        parsed = torchrun.parse_args(args)
        if parsed.max_restarts > 0:
            # The ranks' store is the agent's by default, shared by every attempt, and the keys
            # of the process group's first attempt are still in it: restarted gloo ranks can
            # read their dead predecessors' addresses and hang (pytorch/pytorch#135712).
            # Without sharing, each attempt's rank 0 hosts a fresh store on a fresh port.
            os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        watch = _watch_agent(folder, _shown_ranks(parsed.local_ranks_filter))
        os.environ.pop(job_store.JOB_STORE_ENV, None)  # not another launcher's
        if parsed.rdzv_backend == "c10d" and parsed.rdzv_endpoint:
            host, port = parse_rendezvous_endpoint(parsed.rdzv_endpoint, default_port=29400)
            if port:  # 0: a free port torchrun picks, on one node (run_train.sh)
                os.environ[job_store.JOB_STORE_ENV] = f"{host}:{port}"
        torchrun.run(parsed)
        if (record := preempted(folder)) is not None:
            print(_preemption_line(record), file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        return 0
    except SignalException as e:
        # This process was signalled: torchrun passed the signal to the ranks and waited.
        if (record := preempted(folder)) is not None:
            print(_preemption_line(record), file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        print(
            f"[launcher] stopped by {e.sigval.name}: the ranks stopped without saving (SIGTERM "
            "or SIGUSR1 to this process saves the current step first)",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if records := refusals(folder):
            return _print_refusal(records)
        crashed = crashes(folder)
        # A rank ended by its watchdog, stopped on losing a peer, or whose exception is
        # recorded, says why in its own lines: torchrun's report (exit codes, no traceback)
        # adds nothing then.
        unrecorded = _unrecorded_causes(e.failures, crashed).values()
        if any(f.exitcode not in (HANG_EXIT_CODE, LOST_PEER_EXIT_CODE) for f in unrecorded):
            print(e.format_msg(), file=sys.stderr)
        # torchrun's "Root Cause" is the earliest failure it saw, and a rank that lost contact
        # with a dead one can be seen first; this line orders them by what they say.
        causes = _causes(e.failures, crashed)
        hidden = _hidden_traceback(crashed, e.failures, watch.shown)
        failed = f"[launcher] the job failed: {causes}"
        print(*hidden, failed, *watch.hang, sep="\n", file=sys.stderr)
        return 1
    except RendezvousError as e:
        # Several nodes. Once the ranks run, this agent keeps watching the rendezvous, and the
        # node hosting it can end first (its ranks failed there; this agent then stops its
        # own): a refusal found in the job's store is the reason to print. Before, the
        # rendezvous could not be reached or made at all.
        if records := refusals(folder):
            return _print_refusal(records)
        cause = (str(e.__cause__ or e).strip().splitlines() or [type(e).__name__])[0]
        if watch.restarting is not None:
            # The ranks failed and this node came back to meet again, but the other nodes had
            # ended (closed the rendezvous, or taken its store along). An agent also restarts
            # its ranks without counting it when a node arrives to meet again, so one node can
            # have a restart left that the others do not.
            print(
                f"[launcher] the job failed: {watch.restarting}; the other nodes did not come "
                f"back to restart ({cause})",
                file=sys.stderr,
            )
        elif watch.started.is_set() and isinstance(e, RendezvousConnectionError):
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


class _Watch:
    """What the agent's monitoring saw, for :func:`main`'s report: whether the ranks ran, the
    causes of the failure it is restarting from (until the ranks start again), the last
    attempt's hang lines; and which local ranks' consoles are shown (None: all)."""

    def __init__(self, shown: set[int] | None):
        self.started = threading.Event()
        self.restarting: str | None = None
        self.hang: list[str] = []
        self.shown = shown


def _watch_agent(folder: str, shown: set[int] | None) -> _Watch:
    """Print each restart of the ranks with its cause, and do not restart after a refusal.

    torchrun's agent decides restarts in its monitoring loop and logs them without the cause;
    the failure is in the ``RunResult`` that ``_monitor_workers`` (the method an agent
    implements) returns, so this wraps that method of the local agent. It also wraps
    ``_restart_workers``, to say a restart the agent makes without counting it (its ranks
    healthy, another node came back to meet again), and ``_start_workers``, to forget the
    crashes of an earlier attempt (only a start marks a new attempt on every node)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    watch = _Watch(shown)
    monitor = getattr(
        LocalElasticAgent._monitor_workers, "wrapped", LocalElasticAgent._monitor_workers
    )
    start = getattr(LocalElasticAgent._start_workers, "wrapped", LocalElasticAgent._start_workers)
    restart = getattr(
        LocalElasticAgent._restart_workers, "wrapped", LocalElasticAgent._restart_workers
    )

    def restart_and_report(agent, worker_group):
        if watch.restarting is None:  # its ranks are healthy: another node came back to meet
            why = _other_node_restarted(worker_group)
            watch.restarting = why
            print(
                f"[launcher] restarting every rank: {why}; from the last complete checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return restart(agent, worker_group)

    def start_afresh(agent, worker_group):
        clear_crashes(folder)  # the earlier attempt's ranks are stopped
        watch.restarting = None
        os.environ[ATTEMPT_START_ENV] = str(time.time())  # the ranks inherit it
        return start(agent, worker_group)

    def monitor_and_report(agent, worker_group):
        watch.started.set()
        result = monitor(agent, worker_group)
        if not result.is_failed():
            return result
        left = getattr(agent, "_remaining_restarts", 0)
        workers = worker_group.workers
        try:
            hang = hang_lines(folder, workers[0].world_size if workers else None)
        except Exception as e:  # the report must never hide the failure it reports on
            hang = [f"[launcher] the hang: could not read the dumps ({type(e).__name__}: {e})"]
        several_nodes = bool(workers) and workers[0].world_size > len(workers)
        crashed = crashes(folder)
        if refusals(folder):
            agent._remaining_restarts = 0  # the launcher prints the refusal
            if several_nodes:
                time.sleep(_LINGER_S)  # other nodes: see _LINGER_S
        elif left > 0:
            spec = worker_group.spec
            causes = watch.restarting = _causes(result.failures, crashed)
            print(
                *_hidden_traceback(crashed, result.failures, watch.shown),
                f"[launcher] restart {spec.max_restarts - left + 1} of {spec.max_restarts}: "
                f"{causes}; restarting every rank from the last complete checkpoint",
                *hang,
                sep="\n",
                file=sys.stderr,
                flush=True,
            )
        else:
            watch.hang = hang  # printed after torchrun's report of the failure
            if several_nodes and crashed:
                time.sleep(_LINGER_S)  # a crash the others read, maybe in this node's store
        return result

    monitor_and_report.wrapped = monitor
    start_afresh.wrapped = start
    restart_and_report.wrapped = restart
    LocalElasticAgent._monitor_workers = monitor_and_report
    LocalElasticAgent._start_workers = start_afresh
    LocalElasticAgent._restart_workers = restart_and_report
    return watch


def _other_node_restarted(worker_group) -> str:
    """Why another node came back to meet: the crash a rank of this attempt published in the
    rendezvous's store, if any (under NCCL this node's ranks may still be waiting in a
    collective for the rank that died, and say nothing)."""
    other = "another node restarted its ranks"
    rendezvous = os.environ.get(job_store.JOB_STORE_ENV)
    if not rendezvous:
        return other
    run = worker_group.spec.rdzv_handler.get_run_id()
    master = f"{worker_group.master_addr}:{worker_group.master_port}"
    crash = job_store.crash_of_attempt(rendezvous, run, master)
    if crash is None:
        return other
    return f"{other}: {_crash_causes([crash | {'copied_by': None}])[0]}"  # another node's


def _shown_ranks(local_ranks_filter: str | None) -> set[int] | None:
    """The local ranks whose console torchrun shows (``--local-ranks-filter``); None: all."""
    if not local_ranks_filter:
        return None
    try:
        return {int(r) for r in local_ranks_filter.split(",")}
    except ValueError:
        return None  # torchrun refuses it itself


def _hidden_traceback(crashed: list[dict], failures: dict, shown: set[int] | None) -> list[str]:
    """The traceback of the crash that started it, prefixed by its rank, when it happened on
    this node and ``LOG_RANK`` hid that rank's console; else nothing (it is above, or on its
    own node's console)."""
    causes = _crash_split(crashed, failures)[0]
    if not causes or "copied_by" in causes[0] or shown is None:
        return []
    first = causes[0]
    if first.get("local_rank") in shown:
        return []
    return [f"[rank{first['rank']}]: {line}" for line in first.get("traceback", "").splitlines()]


def _follows(failure, earliest: int) -> bool:
    """Whether a failure without a record only followed the first ones torchrun saw: it lost a
    peer, torchrun stopped it, or it ended later (``timestamp`` in whole seconds)."""
    return failure.timestamp > earliest or failure.exitcode in (LOST_PEER_EXIT_CODE, -_SIGTERM)


def _unrecorded_causes(failures: dict, crashed: list[dict]) -> dict:
    """The failures without a record (a kill, the watchdog, a lost peer's exit code) that did
    not only follow the first ones torchrun saw, by rank."""
    earliest = min(f.timestamp for f in failures.values()) if failures else 0
    told = {c["rank"] for c in crashed}
    return {r: f for r, f in failures.items() if r not in told and not _follows(f, earliest)}


def _crash_split(crashed: list[dict], failures: dict) -> tuple[list[dict], list[dict]]:
    """The recorded exceptions that started it, and those that followed. A rank that raised
    is a cause even when torchrun saw it end after the ranks that lost it (killed while it
    exited); but an exception raised a second or more after the first one, or after a failure
    without a record (a kill), is a consequence: a rank that raised because its peer died."""
    if not crashed:
        return [], []
    unrecorded = _unrecorded_causes(failures, crashed).values()
    limit = min([crashed[0]["time"] + 1, *(f.timestamp + 1 for f in unrecorded)])
    causes = [c for c in crashed if c["time"] < limit]
    return causes, [c for c in crashed if c not in causes]


def _causes(failures: dict, crashed: list[dict] | None = None) -> str:
    """The ranks' failures, those that started it first: ``rank 1 was killed by SIGKILL (then
    rank 0 lost contact and stopped)``; a recorded exception as ``rank 1 raised ValueError:
    ...`` (also another node's, copied here by a rank that lost it). Then come the ranks that
    followed (:func:`_follows`, :func:`_crash_split`); when every failure is of that kind and
    none is recorded (a network fault), they are all listed."""
    crashed = crashed or []
    causes, after = _crash_split(crashed, failures)
    told = {c["rank"] for c in crashed}
    first = _unrecorded_causes(failures, crashed)
    if not first and not causes:
        first = {r: f for r, f in failures.items() if r not in told}
    rest = [r for r in failures if r not in first and r not in told]
    lost = [r for r in rest if failures[r].exitcode == LOST_PEER_EXIT_CODE]
    stopped = [r for r in rest if r not in lost]
    then = [f"{ranks_text(lost)} lost contact and stopped"] if lost else []
    then += [f"{ranks_text(stopped)} stopped by torchrun"] if stopped else []
    then += [f"{ranks_text([c['rank']])} failed too ({c['error'].split(':')[0]})" for c in after]
    parts = _crash_causes(causes) + [_cause(rank, f) for rank, f in sorted(first.items())]
    return "; ".join(parts) + (f" (then {'; '.join(then)})" if then else "")


def _crash_causes(crashed: list[dict]) -> list[str]:
    """``rank 1 raised ValueError: ... (traceback in <log>)``, ranks that raised alike named
    together; another node's with its host. Past three different errors (eight ranks out of
    memory, each by its own count of bytes), the rest are only counted."""
    groups: dict[tuple, list[dict]] = {}
    for record in crashed:
        where = record["host"] if "copied_by" in record else None
        groups.setdefault((record["error"], where), []).append(record)
    parts, shown = [], list(groups.items())[:_CRASH_GROUPS_SHOWN]
    for (error, where), records in shown:
        first, ranks = records[0], [r["rank"] for r in records]
        on = f", on {where}," if where else ""
        whose = "" if len(ranks) == 1 else f"rank {first['rank']}'s "
        there = " there" if where else ""
        tail = f" ({whose}traceback in {first['log']}{there})" if first.get("log") else ""
        parts.append(f"{ranks_text(ranks)}{on} raised {error}{tail}")
    if rest := [r["rank"] for _, records in list(groups.items())[len(shown) :] for r in records]:
        parts.append(f"{ranks_text(rest)} raised too (see their log files)")
    return parts


def _cause(rank: int, failure) -> str:
    """``rank 1 was killed by SIGKILL`` / ``rank 0 exited with code 124 (the hang watchdog)``."""
    if failure.exitcode < 0:
        return f"rank {rank} was killed by {failure.signal_name()}"
    known = {
        HANG_EXIT_CODE: " (the hang watchdog)",
        1: " (an exception; its traceback is in its output)",
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

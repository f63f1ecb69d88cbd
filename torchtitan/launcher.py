"""``python -m torchtitan.launcher [torchrun flags] -m torchtitan.train ...``: torchrun, with
each failure told once, by its cause.

The ranks leave records of why they stop in a folder this launcher makes
(``failure_records.py``), and its lines are built from them (``failure_report.py``). In a job
of several nodes a refusal, a crash or a kill also reaches the other nodes' launchers through
the job's store, and the launcher whose failure ends the job says so there: another node's ranks
still waiting for the dead ones (in an NCCL collective) are then stopped. When the job fails:

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
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from torchtitan import failure_report, job_store, other_nodes
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
from torchtitan.tools.hang_report import ranks_text

SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# After a refusal or a crash in a job of several nodes, how long the agent waits before it ends
# (and with it the store, when it hosts it): the other nodes' ranks learn of it when the
# failing rank's process exits, and read it from the store in the meantime (milliseconds,
# unloaded).
_LINGER_S = 5.0
# A node whose ranks still run when another node's failure ended the job (under NCCL they can
# wait in a collective for the ranks that are gone until its timeout): how often its agent
# looks for that end in the rendezvous's store, and how long its ranks then have to notice by
# themselves (gloo's do at once) or, once one of them said why it stops, to finish leaving;
# then they are killed. Look and grace together stay within _LINGER_S, the time that end
# stays readable when the failed node hosts the store; if it goes first, torchrun stops the
# ranks, by SIGKILL as well (see _watch_agent).
_END_POLL_S = 1.0
_END_GRACE_S = 3.0
_END_LEAVE_S = 30.0
# When this node's ranks only lost ranks of another node, about how long its agent waits for
# that node's agent to publish why (see other_nodes.failure_elsewhere).
_THERE_WAIT_S = 3.0


class _EndedElsewhere(Exception):
    """Another node's failure ended the job; this node's ranks (``ranks``) were still running
    and have been stopped."""

    def __init__(self, worker_group):
        self.ranks = sorted(w.global_rank for w in worker_group.workers)
        super().__init__(f"the job ended on another node; stopped {self.ranks}")


def _name_the_attempt(worker_group) -> None:
    """The attempt's name, alike on every node (``job_store.attempt_name``), in
    ``job_store.ATTEMPT_ENV`` for this agent's records and its ranks': attempts are then told
    apart without comparing clocks of different nodes. No name with one node (its folder is
    enough), under the static rendezvous (the restart count names attempts), or when the store
    does not answer (then a record's time, against this attempt's start here, decides)."""
    os.environ.pop(job_store.ATTEMPT_ENV, None)  # an earlier attempt's
    round_store = getattr(worker_group, "store", None)
    if round_store is None or not os.environ.get(job_store.JOB_STORE_ENV):
        return
    if _several_nodes(worker_group) and (name := job_store.attempt_name(round_store)):
        os.environ[job_store.ATTEMPT_ENV] = name


def _several_nodes(worker_group) -> bool:
    """Whether this node's ranks are part of a job of several nodes."""
    workers = worker_group.workers
    return bool(workers) and workers[0].world_size > len(workers)


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
        os.environ.pop(job_store.ATTEMPT_ENV, None)
        if parsed.rdzv_backend == "c10d" and parsed.rdzv_endpoint:
            host, port = parse_rendezvous_endpoint(parsed.rdzv_endpoint, default_port=29400)
            if port:  # 0: a free port torchrun picks, on one node (run_train.sh)
                os.environ[job_store.JOB_STORE_ENV] = f"{host}:{port}"
        torchrun.run(parsed)
        if (record := preempted(folder)) is not None:
            print(failure_report.preemption_line(record), file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        return 0
    except SignalException as e:
        # This process was signalled: torchrun passed the signal to the ranks and waited.
        if (record := preempted(folder)) is not None:
            print(failure_report.preemption_line(record), file=sys.stderr)
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
        if watch.there is not None and "refusal" in watch.there:
            return _print_refusal([watch.there["refusal"]])
        crashed = crashes(folder)
        # A rank ended by its watchdog, stopped on losing a peer, or whose exception is
        # recorded, says why in its own lines: torchrun's report (exit codes, no traceback)
        # adds nothing then.
        unrecorded = failure_report.unrecorded_causes(e.failures, crashed).values()
        if any(f.exitcode not in (HANG_EXIT_CODE, LOST_PEER_EXIT_CODE) for f in unrecorded):
            print(e.format_msg(), file=sys.stderr)
        # torchrun's "Root Cause" is the earliest failure it saw, and a rank that lost contact
        # with a dead one can be seen first; this line orders them by what they say.
        causes = failure_report.causes(e.failures, crashed, watch.there)
        hidden = failure_report.hidden_traceback(crashed, e.failures, watch.shown)
        failed = f"[launcher] the job failed: {causes}"
        print(*hidden, failed, *watch.hang, sep="\n", file=sys.stderr)
        return 1
    except _EndedElsewhere as e:
        return _print_ended_elsewhere(watch.ended, e.ranks)
    except RendezvousError as e:
        # Several nodes. Once the ranks run, this agent keeps watching the rendezvous, and the
        # node hosting it can end first (its ranks failed there; this agent then stops its
        # own): a refusal found in the job's store is the reason to print. Before, the
        # rendezvous could not be reached or made at all.
        if records := refusals(folder):
            return _print_refusal(records)
        if watch.ended is not None:  # its store went with it before this node's ranks stopped
            return _print_ended_elsewhere(watch.ended, None)
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


def _print_ended_elsewhere(end: dict, ranks: list[int] | None) -> int:
    """What ended the job on another node (its agent's record, ``job_store.publish_failure``),
    and that this node's ``ranks``, still running, were stopped (None: their launcher lost
    the rendezvous first); the exit code."""
    if (refusal := end.get("refusal")) is not None:
        return _print_refusal([refusal])
    line = f"the job failed: {failure_report.elsewhere(end)}"
    if ranks:
        were = "were" if len(ranks) > 1 else "was"
        line += f"; {ranks_text(ranks)}, still running on this node, {were} stopped"
    print(f"[launcher] {line}", file=sys.stderr)
    return 1


class _Watch:
    """What the agent's monitoring saw, for :func:`main`'s report: whether the ranks ran, the
    causes of the failure it is restarting from (until the ranks start again), the last
    attempt's hang lines, another node's end of the job (``ended``, read at ``ended_at``), the
    failure of another node that this node's ranks only lost (``there``); and which local
    ranks' consoles are shown (None: all)."""

    def __init__(self, shown: set[int] | None):
        self.started = threading.Event()
        self.restarting: str | None = None
        self.hang: list[str] = []
        self.shown = shown
        self.ended: dict | None = None
        self.ended_at = 0.0
        self.there: dict | None = None
        self.next_look = 0.0


def _watch_agent(folder: str, shown: set[int] | None) -> _Watch:
    """Print each restart of the ranks with its cause, and do not restart after a refusal or
    once another node ended the job; on several nodes, tell the others why this node's ranks
    failed, and stop ranks still running when another node ended the job (``other_nodes.py``).

    torchrun's agent decides restarts in its monitoring loop and logs them without the cause;
    the failure is in the ``RunResult`` that ``_monitor_workers`` (the method an agent
    implements) returns, so this wraps that method of the local agent; while the ranks run, it
    is also where this agent looks for another node's end of the job. It also wraps
    ``_restart_workers``, to say a restart the agent makes without counting it (its ranks
    healthy, another node came back to meet again), ``_start_workers``, to forget the crashes
    of an earlier attempt (only a start marks a new attempt on every node), and ``_shutdown``,
    to stop by SIGKILL ranks that wait for ranks gone with another node's end of the job."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    watch = _Watch(shown)
    monitor = getattr(
        LocalElasticAgent._monitor_workers, "wrapped", LocalElasticAgent._monitor_workers
    )
    start = getattr(LocalElasticAgent._start_workers, "wrapped", LocalElasticAgent._start_workers)
    restart = getattr(
        LocalElasticAgent._restart_workers, "wrapped", LocalElasticAgent._restart_workers
    )
    shutdown = getattr(LocalElasticAgent._shutdown, "wrapped", LocalElasticAgent._shutdown)

    def restart_and_report(agent, worker_group):
        if watch.ended is not None:  # a third node came back, but the job has ended
            agent._shutdown(signal.SIGKILL)
            raise _EndedElsewhere(worker_group)
        if watch.restarting is None:  # its ranks are healthy: another node came back to meet
            why, failed = other_nodes.why_another_restarted(worker_group)
            if failed:
                # A rank of this attempt died: the ranks here can only be waiting for it (in a
                # collective, under NCCL), with no step to finish and save on SIGTERM (which
                # they take as a preemption); torchrun would wait 30 s before it kills them.
                agent._shutdown(signal.SIGKILL)
            watch.restarting = why
            print(
                f"[launcher] restarting every rank: {why}; from the last complete checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return restart(agent, worker_group)

    def shut_down(agent, death_sig=signal.SIGTERM, *args, **kwargs):
        if watch.ended is not None:  # the ranks wait for ones that are gone: no step to save
            death_sig = signal.SIGKILL
        return shutdown(agent, death_sig, *args, **kwargs)

    def start_afresh(agent, worker_group):
        clear_crashes(folder)  # the earlier attempt's ranks are stopped
        watch.restarting = watch.ended = watch.there = None
        os.environ[ATTEMPT_START_ENV] = str(time.time())  # the ranks inherit it
        _name_the_attempt(worker_group)  # and this
        return start(agent, worker_group)

    def monitor_and_report(agent, worker_group):
        watch.started.set()
        result = monitor(agent, worker_group)
        if not result.is_failed():
            if result.state == WorkerState.HEALTHY:
                _stop_if_the_job_ended(agent, worker_group, watch, folder)
            return result
        left = getattr(agent, "_remaining_restarts", 0)
        workers = worker_group.workers
        try:
            hang = failure_report.hang_lines(folder, workers[0].world_size if workers else None)
        except Exception as e:  # the report must never hide the failure it reports on
            hang = [f"[launcher] the hang: could not read the dumps ({type(e).__name__}: {e})"]
        several_nodes = _several_nodes(worker_group)
        crashed = crashes(folder)
        if watch.ended is None and several_nodes and left > 0:
            watch.ended = other_nodes.end_of_attempt(worker_group)
        refused = refusals(folder)
        watch.there = None
        own = refused or crashed or failure_report.unrecorded_causes(result.failures, crashed)
        if several_nodes and not own:  # the ranks here only lost ranks of another node
            _look_there(worker_group, watch, left)
        refused_there = watch.there is not None and "refusal" in watch.there
        final = bool(refused) or refused_there or left == 0 or watch.ended is not None
        # The other nodes' agents read it, when its cause is this node's.
        published = several_nodes and other_nodes.publish_failure(
            worker_group, result.failures, crashed, refused, final=final
        )
        if refused or refused_there:
            agent._remaining_restarts = 0  # the launcher prints the refusal
            if refused and several_nodes:
                time.sleep(_LINGER_S)  # other nodes: see _LINGER_S
        elif not final:
            spec = worker_group.spec
            causes = failure_report.causes(result.failures, crashed, watch.there)
            watch.restarting = causes
            print(
                *failure_report.hidden_traceback(crashed, result.failures, watch.shown),
                f"[launcher] restart {spec.max_restarts - left + 1} of {spec.max_restarts}: "
                f"{causes}; restarting every rank from the last complete checkpoint",
                *hang,
                sep="\n",
                file=sys.stderr,
                flush=True,
            )
        else:
            agent._remaining_restarts = 0  # when another node ended the job: none to meet again
            watch.hang = hang  # printed after torchrun's report of the failure
            if several_nodes and (crashed or published):
                time.sleep(_LINGER_S)  # the others read it, maybe in this node's store
        return result

    monitor_and_report.wrapped = monitor
    start_afresh.wrapped = start
    restart_and_report.wrapped = restart
    shut_down.wrapped = shutdown
    LocalElasticAgent._monitor_workers = monitor_and_report
    LocalElasticAgent._start_workers = start_afresh
    LocalElasticAgent._restart_workers = restart_and_report
    LocalElasticAgent._shutdown = shut_down
    return watch


def _look_there(worker_group, watch: _Watch, left: int) -> None:
    """This node's ranks only lost ranks of another node: why those failed, from that node's
    agent's record (``watch.there``), and whether that ended the job (``watch.ended``)."""
    watch.there = watch.ended or other_nodes.failure_elsewhere(worker_group, _THERE_WAIT_S)
    if watch.there is not None and watch.ended is None and left > 0:
        # That node may have had no restart left where this one has one: its end is published
        # with its failure, which was not there yet when this agent looked for an end.
        watch.ended = other_nodes.end_of_attempt(worker_group)


def _stop_if_the_job_ended(agent, worker_group, watch: _Watch, folder: str) -> None:
    """While this node's ranks run, look (every ``_END_POLL_S``) whether another node's
    failure ended the job in this attempt; if so, and the ranks neither stop by themselves
    within ``_END_GRACE_S`` nor, having said why they stop, within ``_END_LEAVE_S``, kill
    them and raise :class:`_EndedElsewhere`. Under gloo they notice at once and this never
    acts; under NCCL they can wait in a collective for the dead ranks until its timeout."""
    if not _several_nodes(worker_group):
        return
    now = time.monotonic()
    if watch.ended is None:
        if now < watch.next_look:
            return
        watch.next_look = now + _END_POLL_S
        if (end := other_nodes.end_of_attempt(worker_group)) is None:
            return
        watch.ended, watch.ended_at = end, now
    # A rank here noticed, and is leaving (or its watchdog is writing its dumps).
    leaving = refusals(folder) or crashes(folder) or read_records(folder, "hung-rank")
    if now - watch.ended_at < (_END_LEAVE_S if leaving else _END_GRACE_S):
        return
    # Waiting for ranks that are gone: no step to finish and save on SIGTERM (torchrun would
    # wait TORCH_ELASTIC_SHUTDOWN_TIMEOUT for it, 600 s by default here).
    agent._shutdown(signal.SIGKILL)
    raise _EndedElsewhere(worker_group)


def _shown_ranks(local_ranks_filter: str | None) -> set[int] | None:
    """The local ranks whose console torchrun shows (``--local-ranks-filter``); None: all."""
    if not local_ranks_filter:
        return None
    try:
        return {int(r) for r in local_ranks_filter.split(",")}
    except ValueError:
        return None  # torchrun refuses it itself


class _Dropping:
    """A text stream that passes every line except some that mean nothing to a user: torch's
    C++ profiler markers (``USDT: ... profiler_start``), which kineto prints on every profiled
    step, and c10d's C++ log lines for a peer that went away, whatever the cause: gloo's
    (``[E1129 ... ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with [.../pair.cc:553]
    Connection closed by peer ...``) and the store's (``[W1130 ... TCPStore.cpp:138] [c10d]
    recvValueWithTimeout failed on ...: Failed to recv, got 0 bytes. Connection was likely
    closed. ...``, then its C++ stack: ``Exception raised from ...``, ``frame #0: ...``, a
    blank line). The same words are in the exception the rank then reports in one line (exit
    code ``LOST_PEER_EXIT_CODE``) and keeps, with its traceback, in its log file."""

    _LOGS = ("ProcessGroupGloo.cpp:", "TCPStore.cpp:")
    _STACK = ("Exception raised from ", "frame #", "<omitting python frames>")
    _STACK_LINES = 100  # at most, after one dropped line (c10d's stacks have about 40)

    def __init__(self, stream):
        self._stream = stream
        self._in_stack: dict[str, int] = {}  # rank: lines of its dropped line's stack left

    def write(self, text: str) -> int:
        # torchrun writes one line per call, after its "[rank0]:" prefix.
        rank, _, line = text.partition("]:")
        if (left := self._in_stack.pop(rank, 0)) > 0:
            if not line.strip():  # the blank line that ends a C++ stack
                return len(text)
            if line.startswith(self._STACK):
                self._in_stack[rank] = left - 1
                return len(text)
        if "USDT:" in text and "profiler_" in text:
            return len(text)
        if any(log in text for log in self._LOGS) and any(m in text for m in LOST_PEER_MARKERS):
            self._in_stack[rank] = self._STACK_LINES
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

"""A rank whose collective lost another rank is told apart from one that failed by itself
(``train.py`` then says so in one line and exits ``failure_records.LOST_PEER_EXIT_CODE``)."""

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchtitan import failure_records, failure_report, job_store, launcher, other_nodes
from torchtitan.distributed.utils import lost_peer

# Raised in rank 0 by torch 2.13's gloo when rank 1 was killed mid-step (seen both ways).
CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:42693. This is typically caused by a remote worker crashing. Check the "
    "logs of the remote worker."
)
RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:61077: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application."
)

# Raised in rank 0 by init_process_group when rank 1 had joined the group, refused its input
# and exited before rank 0's side of the mesh was connected (seen in CI under load).
MESH = (
    "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:553] Connection closed by peer [127.0.0.1]:5859. This is typically caused by a "
    "remote worker crashing. Check the logs of the remote worker before reporting an error."
)


@pytest.mark.parametrize(
    "text, words",
    [
        (CLOSED, "Connection closed by peer [127.0.0.1]:42693"),
        (RESET, "Read error [127.0.0.1]:61077: Connection reset by peer"),
        (MESH, "Connection closed by peer [127.0.0.1]:5859"),
    ],
)
def test_the_backends_words_are_kept_without_the_source_path(text, words):
    assert lost_peer(RuntimeError(text)) == words


def test_a_lost_peer_is_found_under_the_error_raised_from_it():
    try:
        try:
            raise RuntimeError(CLOSED)
        except RuntimeError as e:
            raise ValueError("checkpoint save failed on rank 0") from e
    except ValueError as wrapped:
        assert lost_peer(wrapped) == "Connection closed by peer [127.0.0.1]:42693"


def test_the_store_and_nccl_report_through_torchs_distributed_errors():
    store = torch.distributed.DistNetworkError("Broken pipe")
    assert lost_peer(store) == "Broken pipe"
    # A store op of a rank whose store host (rank 0, with restarts on) went away.
    hosted = torch.distributed.DistNetworkError(
        "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server "
        "shutdown or crash?"
    )
    assert lost_peer(hosted) == "Failed to recv, got 0 bytes"
    # NCCL's wording for ncclRemoteError (the error name itself is on the second line).
    nccl = torch.distributed.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:2073, remote process exited or there was a network "
        "error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a network "
        "error or a remote process exiting prematurely."
    )
    assert lost_peer(nccl) is not None


@pytest.mark.parametrize(
    "error",
    [
        # A dataloader worker's exception, re-raised with the worker's traceback as its text.
        RuntimeError(
            "Caught ClientConnectorError in DataLoader worker process 0.\nOriginal Traceback "
            "(most recent call last):\n  ...\nConnection reset by peer"
        ),
        # The words on the first line, but not from a backend.
        RuntimeError("Connection reset by peer while reading https://example.com/c4.json.gz"),
        # Another library's message quoting a path under gloo/ is not gloo's own.
        RuntimeError("Failed with [see third_party/gloo/README] Connection reset by peer"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
        KeyError("peer"),
        # This process's own pipe (a dataloader worker that died), not another rank.
        BrokenPipeError(32, "Broken pipe"),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
)
def test_other_errors_are_not_a_lost_peer(error):
    assert lost_peer(error) is None


def test_a_schedules_log_of_a_lost_peer_is_dropped(caplog):
    """A multi-stage pipeline schedule logs the error it catches and its whole timetable (90
    lines): dropped for a lost peer, which the entry point reports in one line."""
    import logging

    from torchtitan.distributed import pipeline_parallel

    schedules = logging.getLogger("torch.distributed.pipelining.schedules")
    schedules.addFilter(pipeline_parallel._not_a_lost_peer)
    try:
        with caplog.at_level(logging.ERROR, logger=schedules.name):
            for error in (RuntimeError(RESET), RuntimeError("a stage's own failure")):
                try:
                    raise error
                except RuntimeError:
                    schedules.error("caught %s", error)
            schedules.error("outside any error")
    finally:
        schedules.removeFilter(pipeline_parallel._not_a_lost_peer)
    assert [r.getMessage() for r in caplog.records] == [
        "caught a stage's own failure",
        "outside any error",
    ]


def test_the_launcher_drops_c10ds_cpp_lines_for_a_lost_peer():
    """Rank 0's gloo logs from C++, before raising, the same words the rank then says in its
    own line: the launcher's copy of the ranks' streams drops that log line and keeps gloo's
    other lines (seen in CI: rank 1 refused its input while rank 0 was joining the group). The
    store's warning goes too, with the C++ stack that follows it."""
    import io

    from torchtitan.launcher import _Dropping

    logged = "[rank0]:[E1129 15:09:10.408535417 ProcessGroupGloo.cpp:67] " + MESH.replace(
        "5859", "45704"
    )
    other = "[rank0]:[W1129 15:09:10.40 ProcessGroupGloo.cpp:516] Warning: a gloo warning"
    own = "[rank0]: 15:09:10 ERROR Stopping: another rank went away during a collective (...)"
    # The store's, seen in CI: rank 1 joining a group when rank 0 exited; then its C++ stack.
    store = (
        "[rank1]:[W1130 00:41:30.754955881 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed "
        "on SocketImpl(fd=3, ...): Failed to recv, got 0 bytes. Connection was likely closed. "
        "Did the remote server shutdown or crash?"
    )
    stack = [
        "[rank1]:Exception raised from recvBytes at .../c10d/Utils.hpp:787 (most recent call first):",
        "[rank1]:frame #0: c10::Error::Error(c10::SourceLocation, ...) + 0x9d (0x7f7f in libc10.so)",
        "[rank1]:<omitting python frames>",
        "[rank1]:frame #37: _start + 0x21 (0x559ef5eee081 in .venv/bin/python)",
        "[rank1]:",
    ]
    own_1 = own.replace("[rank0]", "[rank1]")
    stream = io.StringIO()
    dropping = _Dropping(stream)
    later = ("[rank1]:frame #1: x", "[rank1]:")
    lines = (logged, other, store, stack[0], own, *stack[1:], *later, store, *stack[:2], own_1)
    for line in lines:
        assert dropping.write(line + "\n") == len(line) + 1
    # A stack ends at its blank line, or at the rank's next line of another kind; another
    # rank's lines pass between.
    assert stream.getvalue().splitlines() == [other, own, *later, own_1]


def _node(monkeypatch, tmp_path, name: str, rank: int, port: int) -> Path:
    """The environment of ``rank`` under a launcher of its own (a node) in a job of 4 ranks on 2
    nodes, torchrun's shared store at ``port``."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    env = {
        failure_records.FAILURE_DIR_ENV: str(folder), "RANK": str(rank), "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job7",
    }  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(job_store.JOB_STORE_ENV, raising=False)
    return folder


_AGENT_METHODS = ("_monitor_workers", "_start_workers", "_restart_workers", "_shutdown")


@pytest.fixture(autouse=True)
def _no_kept_store_clients(monkeypatch):
    """The clients a launcher keeps, by address, are this test's alone: an earlier test's store
    may have had the port this test's store has."""
    monkeypatch.setattr(job_store, "_clients", {})


def _keep_agent_methods(monkeypatch):
    """The launcher wraps these methods of torchrun's agent class: put them back after the test."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    for name in _AGENT_METHODS:
        monkeypatch.setattr(LocalElasticAgent, name, getattr(LocalElasticAgent, name))
    return LocalElasticAgent


def _store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _put(store, key: str, value: str) -> None:
    """``store.set``, then read back through the same client: a set returns before the store
    has applied it, and another client (the code under test) could read before it does."""
    store.set(key, value)
    assert store.check([key])


def test_a_refusal_reaches_the_launchers_of_other_nodes_through_the_store(monkeypatch, tmp_path):
    """Rank 3 refuses under the second node's launcher: its record is in that node's folder
    and the job's store. Rank 0, under the first node's launcher, finds none in its folder,
    reads the store's and copies it there (rank 3's, first refusal kept), so that its launcher
    prints that line. Another job meeting at the same store has a key of its own."""
    agent = _store()
    second = _node(monkeypatch, tmp_path, "second", rank=3, port=agent.port)
    assert failure_records.refuse(2, "rank 3's data is empty")
    assert [r["rank"] for r in failure_records.refusals(second)] == [3]
    monkeypatch.setenv("RANK", "2")
    assert failure_records.refuse(
        2, "rank 2 refuses later"
    )  # its own node's record; the store's stays
    first = _node(monkeypatch, tmp_path, "first", rank=0, port=agent.port)
    assert failure_records.refusals(first) == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job8")
    assert not failure_records.a_rank_said_why()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert failure_records.a_rank_said_why()
    [record] = failure_records.refusals(first)
    assert failure_records.format_refusal(record) == "[rank3] error: rank 3's data is empty"
    assert record["code"] == 2


def test_one_node_never_uses_the_store(monkeypatch, tmp_path):
    agent = _store()
    _node(monkeypatch, tmp_path, "only", rank=1, port=agent.port)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert failure_records.refuse(2, "refused")
    assert not agent.check([job_store.key("refusal")])


def test_the_rendezvous_store_is_preferred_to_the_ranks_own(monkeypatch, tmp_path):
    """With restarts on, the ranks' store (``MASTER_PORT``) is rank 0's own and goes with it:
    a refusal is published in the c10d rendezvous's store (the launcher's ``JOB_STORE_ENV``,
    the agents' for the whole job) and read from there."""
    ranks, rendezvous = _store(), _store()
    _node(monkeypatch, tmp_path, "second", rank=1, port=ranks.port)
    monkeypatch.setenv(job_store.JOB_STORE_ENV, f"127.0.0.1:{rendezvous.port}")
    assert failure_records.refuse(2, "rank 1 refuses")
    key = job_store.key("refusal")
    assert rendezvous.check([key]) and not ranks.check([key])
    _node(monkeypatch, tmp_path, "first", rank=0, port=ranks.port)
    monkeypatch.setenv(job_store.JOB_STORE_ENV, f"127.0.0.1:{rendezvous.port}")
    assert failure_records.a_rank_said_why()


def _silent_listener(close: bool) -> tuple[socket.socket, int]:
    """A port that accepts connections and then closes each at once (``close``) or never
    answers: not a store."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        held = []
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            if close:
                connection.close()
            else:
                held.append(connection)

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


@pytest.mark.parametrize("server", ["gone", "closes", "silent"])
def test_without_a_store_that_answers_no_refusal_is_found_quietly(
    monkeypatch, tmp_path, capfd, server
):
    """A store gone (the refusing node's agent ended first), a port that closes each
    connection, one that never answers: no refusal found, within the deadline, and none of
    c10d's C++ lines about the connection on the console."""
    if server == "gone":
        agent = _store()
        port = agent.port
        record = {"rank": 1, "code": 2, "message": "refused", "time": 0.0}
        folder = _node(monkeypatch, tmp_path, "first", rank=0, port=port)
        _put(agent, job_store.key("refusal"), json.dumps(record))
        del agent
    else:
        listener, port = _silent_listener(close=server == "closes")
        folder = _node(monkeypatch, tmp_path, "first", rank=0, port=port)
    started = time.monotonic()
    assert not failure_records.a_rank_said_why()
    assert time.monotonic() - started < job_store._DEADLINE_S + 1
    assert failure_records.refusals(folder) == []
    assert capfd.readouterr().err == ""


def test_a_bad_record_in_the_store_is_not_taken(monkeypatch, tmp_path):
    agent = _store()
    folder = _node(monkeypatch, tmp_path, "first", rank=0, port=agent.port)
    _put(agent, job_store.key("refusal"), json.dumps({"message": "no rank"}))
    assert not failure_records.a_rank_said_why() and failure_records.refusals(folder) == []


def _keep_what_main_sets(monkeypatch) -> None:
    """What ``launcher.main`` sets for its process (environment, streams, torchrun's loggers)
    stays in the test that calls it."""
    import logging

    monkeypatch.setattr(os, "environ", dict(os.environ))
    for stream in ("stdout", "stderr"):
        monkeypatch.setattr(sys, stream, getattr(sys, stream))
    for name in ("torch.distributed.run", "torch.distributed.elastic"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    monkeypatch.setattr(agent_log, "filters", list(agent_log.filters))


@pytest.mark.parametrize("when", ["at_start", "refused", "while_running", "restarting"])
def test_a_rendezvous_error_is_one_line_or_the_refusal_found(monkeypatch, capsys, when):
    """torchrun raises ``RendezvousConnectionError`` when its store cannot be reached at the
    start, or, from its monitoring loop once the ranks run, when the node hosting it ended
    first: one line each, exit 1; or the refusal one of its ranks found in the job's store,
    with its code. Coming back to restart after its ranks failed, it finds the rendezvous
    closed (the others ended) and names the failure it was restarting from."""
    from torch.distributed import DistNetworkError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousConnectionError,
    )

    class Result:
        failures = {1: _Failure(4)}
        state = WorkerState.FAILED if when == "restarting" else WorkerState.HEALTHY

        def is_failed(self) -> bool:
            return when == "restarting"

    def run(args):
        if when != "at_start":
            group = SimpleNamespace(spec=SimpleNamespace(max_restarts=1), workers=[])
            agent = SimpleNamespace(_remaining_restarts=1)
            LocalElasticAgent._monitor_workers(agent, group)  # the ranks run (and fail)
        if when == "restarting":
            raise RendezvousClosedError()
        if when == "refused":
            record = {"rank": 0, "code": 2, "message": "rank 0 refuses", "time": 0.0}
            monkeypatch.setenv("RANK", "1")
            failure_records.write_record("rank", record, rank=0)
        lost = DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
        raise RendezvousConnectionError("The connection to the C10d store has failed.") from lost

    _keep_what_main_sets(monkeypatch)
    _keep_agent_methods(monkeypatch)
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda agent, group: Result())
    monkeypatch.setattr(torchrun, "run", run)
    code = launcher.main(["--nnodes", "2", "--nproc_per_node", "1", "train.py"])
    lines = capsys.readouterr().err.splitlines()
    if when == "refused":
        assert (code, lines) == (2, ["[rank0] error: rank 0 refuses"])
        return
    if when == "restarting":
        restart, end = lines
        assert restart.startswith("[launcher] restart 1 of 1: rank 1 exited with code 4")
        assert end == (
            "[launcher] the job failed: rank 1 exited with code 4 (a collective lost another "
            "rank); the other nodes did not come back to restart (RendezvousClosedError)"
        )
        return
    assert code == 1 and len(lines) == 1, lines
    if when == "at_start":
        assert lines[0] == (
            "[launcher] the rendezvous failed: RendezvousConnectionError: Failed to recv, got 0 "
            "bytes. Connection was likely closed."
        )
    else:
        assert lines[0].startswith("[launcher] this node lost the job's rendezvous (Failed to recv")


def test_a_crash_reaches_the_launchers_of_other_nodes_through_the_store(monkeypatch, tmp_path):
    """Rank 3 raises under the second node's launcher: its record (first line, traceback, log
    file) is in that node's folder, and in the job's store without the traceback. Rank 0 on
    the first node, which lost rank 3, copies it to its own folder, marked as copied. Another
    attempt reads only its own: under the static rendezvous one of another restart count,
    under c10d one whose ranks meet at another port."""
    agent = _store()
    second = _node(monkeypatch, tmp_path, "second", rank=3, port=agent.port)
    try:
        raise ValueError("rank 3 found no data\nsecond line")
    except ValueError as e:
        assert failure_records.note_crash(e, "logs/run/rank3.log")
    [own] = failure_records.crashes(second)
    assert own["error"] == "ValueError: rank 3 found no data" and own["rank"] == 3
    assert own["traceback"].endswith("ValueError: rank 3 found no data\nsecond line")
    assert "copied_by" not in own and own["log"] == "logs/run/rank3.log"
    first = _node(monkeypatch, tmp_path, "first", rank=0, port=agent.port)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not failure_records.a_rank_said_why()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert failure_records.a_rank_said_why()
    [copy] = failure_records.crashes(first)
    assert copy["copied_by"] == 0 and copy["rank"] == 3 and "traceback" not in copy
    assert failure_records.refusals(first) == []  # a crash is not a refusal: restarts go on
    failure_records.clear_crashes(first)  # what the launcher does when the ranks start again
    assert failure_records.crashes(first) == [] and failure_records.crashes(second) != []
    # Under c10d the restart count differs between nodes; the ranks' meeting port does not.
    monkeypatch.setenv(job_store.JOB_STORE_ENV, f"127.0.0.1:{agent.port}")
    assert not failure_records.a_rank_said_why()  # published without it: another key
    monkeypatch.setenv("RANK", "3")
    try:
        raise ValueError("rank 3 again")
    except ValueError as e:
        assert failure_records.note_crash(e, None)
    monkeypatch.setenv("RANK", "0")
    failure_records.clear_crashes(first)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert failure_records.a_rank_said_why()
    # A crash older than this attempt's start (a store kept across attempts) is not taken.
    failure_records.clear_crashes(first)
    monkeypatch.setenv(failure_records.ATTEMPT_START_ENV, str(time.time() + 10))
    assert not failure_records.a_rank_said_why()
    monkeypatch.delenv(failure_records.ATTEMPT_START_ENV)
    monkeypatch.setenv("MASTER_PORT", str(agent.port + 1))
    assert not failure_records.a_rank_said_why()


class _Failure:
    """What torchrun's ``ProcessFailure`` offers the launcher."""

    def __init__(self, exitcode: int, timestamp: int = 100):
        self.exitcode, self.timestamp = exitcode, timestamp

    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name


def _crash(rank: int, error: str = "ValueError: boom", *, remote: bool = False) -> dict:
    record = {"rank": rank, "error": error, "log": f"logs/run/rank{rank}.log", "host": "node-b"}
    # _Failure's timestamp is 100 (seconds) by default: these crashes are just after it.
    record |= {"local_rank": rank % 2, "time": 100.0 + rank / 10, "traceback": "T\nV"}
    return record | ({"copied_by": 5} if remote else {})


@pytest.mark.parametrize(
    "codes, crashed, line",
    [
        # The crashed rank was killed while it exited, after the rank that lost it: still first.
        (
            {0: 4, 1: -15},
            [_crash(1)],
            "rank 1 raised ValueError: boom (traceback in logs/run/rank1.log) "
            "(then rank 0 lost contact and stopped)",
        ),
        (
            {0: 1, 1: 1},
            [_crash(0), _crash(1)],
            "ranks 0, 1 raised ValueError: boom (rank 0's traceback in logs/run/rank0.log)",
        ),
        # Another node's crash, copied here by the rank that lost it.
        (
            {4: 4, 5: 4},
            [_crash(1, remote=True)],
            "rank 1, on node-b, raised ValueError: boom (traceback in logs/run/rank1.log there) "
            "(then ranks 4, 5 lost contact and stopped)",
        ),
        # An exception a second or more after the first one, or after a kill, followed it.
        (
            {0: 1, 1: 1},
            [_crash(0), _crash(1) | {"time": 101.5}],
            "rank 0 raised ValueError: boom (traceback in logs/run/rank0.log) "
            "(then rank 1 failed too (ValueError))",
        ),
        (
            {1: -9, 0: _Failure(1, timestamp=130)},
            [_crash(0, "DistBackendError: Watchdog timeout") | {"time": 130.0}],
            "rank 1 was killed by SIGKILL (then rank 0 failed too (DistBackendError))",
        ),
        # Past three different errors, the rest are only counted.
        (
            {r: 1 for r in range(5)},
            [_crash(r, f"OutOfMemoryError: {r} GiB") | {"log": None} for r in range(5)],
            "rank 0 raised OutOfMemoryError: 0 GiB; rank 1 raised OutOfMemoryError: 1 GiB; "
            "rank 2 raised OutOfMemoryError: 2 GiB; ranks 3, 4 raised too (see their log files)",
        ),
        # A kill here at the same moment is a cause too.
        (
            {4: -9, 5: 4},
            [_crash(1, remote=True)],
            "rank 1, on node-b, raised ValueError: boom (traceback in logs/run/rank1.log there); "
            "rank 4 was killed by SIGKILL (then rank 5 lost contact and stopped)",
        ),
    ],
)
def test_the_launcher_names_a_recorded_exception_first(codes, crashed, line):
    failures = {r: c if isinstance(c, _Failure) else _Failure(c) for r, c in codes.items()}
    assert failure_report.causes(failures, crashed) == line


def test_a_crashed_ranks_traceback_is_shown_where_its_console_was_not():
    """Rank 1's, when LOG_RANK shows only rank 0; also when the shown rank 0 raised too, but
    later: a consequence."""
    failures = {0: _Failure(4), 1: _Failure(1)}
    shown = failure_report.hidden_traceback([_crash(1)], failures, shown={0})
    assert shown == ["[rank1]: T", "[rank1]: V"]
    later = _crash(0) | {"time": 104.0}
    assert failure_report.hidden_traceback([_crash(1), later], failures, shown={0}) == shown
    assert failure_report.hidden_traceback([_crash(1)], failures, shown={0, 1}) == []  # it is above
    assert failure_report.hidden_traceback([_crash(1)], failures, shown=None) == []  # all are shown
    remote = _crash(1, remote=True)
    assert failure_report.hidden_traceback([remote], failures, shown={0}) == []  # another node's
    assert launcher._shown_ranks("0,1") == {0, 1} and launcher._shown_ranks(None) is None


def test_a_crash_record_keeps_a_long_tracebacks_ends_and_never_raises(monkeypatch, tmp_path):
    """An error with 400 lines of message (a compiler's output) keeps the traceback's head and
    its end, and says where all of it is; an error that cannot be printed leaves no record
    rather than an exception of its own."""
    folder = _node(monkeypatch, tmp_path, "only", rank=1, port=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one node: no store
    try:
        raise RuntimeError("compile failed\n" + "\n".join(f"line {i}" for i in range(400)))
    except RuntimeError as e:
        assert failure_records.note_crash(e, "logs/run/rank1.log")
    [record] = failure_records.crashes(folder)
    lines = record["traceback"].splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == "line 399"
    assert len(lines) == 201 and "lines cut; all of it in logs/run/rank1.log" in lines[40]

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no")

    failure_records.clear_crashes(folder)
    assert not failure_records.note_crash(Unprintable(), None)
    assert failure_records.crashes(folder) == []


def test_a_restart_for_another_nodes_return_is_said_with_its_crash(monkeypatch, tmp_path, capsys):
    """An agent whose ranks are healthy restarts them, without counting a restart, when
    another node comes back to meet again (its rank raised; under NCCL this node's ranks may
    still wait for it in a collective and say nothing): the launcher says so, with the crash
    that rank published in the rendezvous's store for this attempt."""
    LocalElasticAgent = _keep_agent_methods(monkeypatch)
    restarted = []
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda a, g: restarted.append(g))
    monkeypatch.setattr(LocalElasticAgent, "_start_workers", lambda a, g: None)
    rendezvous = _store()
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setenv(job_store.JOB_STORE_ENV, f"127.0.0.1:{rendezvous.port}")
    monkeypatch.delenv(failure_records.ATTEMPT_START_ENV, raising=False)  # the first attempt
    record = {"rank": 3, "error": "ValueError: boom", "host": "node-b", "log": "L"}
    record["time"] = time.time()
    _put(rendezvous, "titan/crash/job7/10.0.0.1:29501", json.dumps(record))
    launcher._watch_agent(str(tmp_path), None)
    handler = SimpleNamespace(get_run_id=lambda: "job7")
    group = SimpleNamespace(
        spec=SimpleNamespace(rdzv_handler=handler), master_addr="10.0.0.1", master_port=29501
    )
    group.group_rank, group.workers = 0, []
    killed = []
    agent = SimpleNamespace(_shutdown=killed.append)
    LocalElasticAgent._restart_workers(agent, group)
    assert killed == [signal.SIGKILL]  # its ranks can only wait for the dead one: no SIGTERM
    LocalElasticAgent._start_workers(agent, group)  # the ranks start again
    group.master_port = 29502  # another attempt: no crash published in it
    LocalElasticAgent._restart_workers(agent, group)
    assert restarted == [group, group] and killed == [signal.SIGKILL]  # a scale-up saves first
    # A kill there: no rank's record, its agent's.
    LocalElasticAgent._start_workers(agent, group)
    killed_there = _end(1, master="10.0.0.1:29503", causes="rank 3 was killed by SIGKILL")
    _put(rendezvous, "titan/failed/job7/10.0.0.1:29503", json.dumps(killed_there))
    group.master_port = 29503
    LocalElasticAgent._restart_workers(agent, group)
    assert killed == [signal.SIGKILL] * 2
    assert capsys.readouterr().err.splitlines() == [
        "[launcher] restarting every rank: another node restarted its ranks: rank 3, on node-b, "
        "raised ValueError: boom (traceback in L there); from the last complete checkpoint",
        "[launcher] restarting every rank: another node restarted its ranks; from the last "
        "complete checkpoint",
        "[launcher] restarting every rank: another node restarted its ranks: on node-b, rank 3 "
        "was killed by SIGKILL; from the last complete checkpoint",
    ]


def _end(node: int, **fields) -> dict:
    record = {"node": node, "host": "node-b", "master": "10.0.0.1:29501", "causes": "C"}
    return record | {"crashes": [], "time": time.time()} | fields


def _agents_view(monkeypatch, node: int, port: int = 29501, ranks=(2, 3)):
    """An attempt of job7 meeting at 10.0.0.1:``port``, as node ``node``'s agent sees it (a
    worker group of ``ranks`` out of 4), the rendezvous's store in the launcher's environment;
    and that store."""
    rendezvous = _store()
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setenv(job_store.JOB_STORE_ENV, f"127.0.0.1:{rendezvous.port}")
    spec = SimpleNamespace(rdzv_handler=SimpleNamespace(get_run_id=lambda: "job7"), max_restarts=1)
    workers = [SimpleNamespace(world_size=4, global_rank=r) for r in ranks]
    group = SimpleNamespace(spec=spec, master_addr="10.0.0.1", master_port=port)
    group.group_rank, group.workers = node, workers
    return group, rendezvous


def test_a_nodes_failure_and_end_of_the_job_reach_the_others_agents(monkeypatch):
    """An agent whose ranks failed for a cause of their own publishes it for the attempt; with
    no restart left, as the job's end too; the first of each kept. Ranks that only lost another
    node's publish nothing; a record with a malformed crash is not read back."""
    group, rendezvous = _agents_view(monkeypatch, node=0)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    address = f"127.0.0.1:{rendezvous.port}"
    crash = _crash(1)
    lost = {2: _Failure(failure_records.LOST_PEER_EXIT_CODE)}
    assert not other_nodes.publish_failure(group, lost, [], [], final=True)
    assert other_nodes.publish_failure(group, {}, [crash], [], final=False)  # a restart left
    failed = job_store.failure_of_attempt(address, "job7", "10.0.0.1:29501")
    assert failed["node"] == 0 and failed["causes"].startswith("rank 1 raised ValueError: boom")
    assert failed["crashes"] == [{k: v for k, v in crash.items() if k != "traceback"}]
    assert job_store.end_of_job(address, "job7") is None
    group.master_port = 29502  # the next attempt, the last
    assert other_nodes.publish_failure(group, {0: _Failure(-9)}, [], [], final=True)
    group.group_rank = 1
    assert other_nodes.publish_failure(group, {2: _Failure(-9)}, [], [], final=True)  # later
    end = job_store.end_of_job(address, "job7")
    assert (end["node"], end["master"]) == (0, "10.0.0.1:29502")
    assert end["causes"] == "rank 0 was killed by SIGKILL"
    assert other_nodes.end_of_attempt(group) == end  # read by node 1, in that attempt
    monkeypatch.setenv(failure_records.ATTEMPT_START_ENV, str(time.time() + 10))
    assert other_nodes.end_of_attempt(group) is None  # an earlier attempt's, met at its port
    monkeypatch.delenv(failure_records.ATTEMPT_START_ENV)
    group.group_rank = 0
    assert other_nodes.end_of_attempt(group) is None  # its own
    group.group_rank, group.master_port = 1, 29501
    assert other_nodes.end_of_attempt(group) is None  # another attempt's
    _put(rendezvous, "titan/failed/job7/x", json.dumps(_end(0, crashes=[{"rank": 1}])))
    assert job_store.failure_of_attempt(address, "job7", "x") is None


def test_an_attempt_is_named_alike_on_every_node_without_comparing_clocks(monkeypatch, tmp_path):
    """Each node's launcher names the attempt in the rendezvous round's store: the first
    agent's name, read alike by every agent, another in the next round. Its ranks' keys and its
    records carry it, so a record read there is this attempt's whatever the clock of the node
    that wrote it said (here an hour behind this node's start), and the same address met again
    in the next round reads nothing of the last. One node's job, or a store that does not
    answer, has no name."""
    from torch.distributed import PrefixStore, TCPStore

    group, rendezvous = _agents_view(monkeypatch, node=1)  # ranks 2 and 3 of 4
    node0 = TCPStore("127.0.0.1", rendezvous.port, is_master=False)
    round0 = "torch.rendezvous.job7.0"  # torchrun's prefix of a round's keys
    group.store = PrefixStore(round0, rendezvous)
    launcher._name_the_attempt(group)
    name = os.environ[job_store.ATTEMPT_ENV]
    assert job_store.attempt_name(PrefixStore(round0, node0)) == name  # node 0's agent
    assert other_nodes.attempt(group) == f"10.0.0.1:29501/{name}"
    for var, value in (("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29501")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert job_store.key("crash") == f"titan/crash/job7/10.0.0.1:29501/{name}"  # a rank's
    crash = _crash(1) | {"time": time.time() - 3600}
    _put(node0, job_store.key("crash"), json.dumps(crash))
    monkeypatch.setenv(failure_records.ATTEMPT_START_ENV, str(time.time()))
    assert other_nodes._failure_there(group) == {"crashes": [crash]}
    group.store = PrefixStore("torch.rendezvous.job7.1", rendezvous)  # the next round
    launcher._name_the_attempt(group)
    assert os.environ[job_store.ATTEMPT_ENV] not in ("", name)
    assert other_nodes._failure_there(group) is None
    # A crash there from a clock an hour ahead, copied by a rank here that lost that rank: timed
    # when it arrived, by this node's clock (the launcher orders crashes and kills by time).
    crash |= {"time": time.time() + 3600}
    before = time.time()
    _put(node0, job_store.key("crash"), json.dumps(crash))
    for var, value in (("RANK", "2"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv(failure_records.FAILURE_DIR_ENV, str(tmp_path))
    assert failure_records.a_rank_said_why()
    [copy] = failure_records.crashes(tmp_path)
    assert copy["copied_by"] == 2 and before <= copy["time"] <= time.time()
    group.workers = [SimpleNamespace(world_size=2, global_rank=r) for r in (0, 1)]
    launcher._name_the_attempt(group)  # one node
    assert job_store.ATTEMPT_ENV not in os.environ
    monkeypatch.setattr(job_store, "_DEADLINE_S", 0.2)
    group.workers, group.store = [SimpleNamespace(world_size=4, global_rank=2)], _Silent()
    launcher._name_the_attempt(group)
    assert job_store.ATTEMPT_ENV not in os.environ
    group.store = _Silent(answers_from=2)  # its answer lost, the name is asked again
    launcher._name_the_attempt(group)
    assert os.environ[job_store.ATTEMPT_ENV] == "taken"


class _Silent:
    """A store that does not answer, or not before its ``answers_from``-th call."""

    def __init__(self, answers_from: int = 0):
        self.calls, self.answers_from = 0, answers_from

    def compare_set(self, *args):
        self.calls += 1
        if not self.answers_from or self.calls < self.answers_from:
            threading.Event().wait()
        return b"taken"


def test_a_nodes_end_of_the_job_stops_the_ranks_that_never_notice(monkeypatch, tmp_path):
    """Another node's agent, whose ranks still run (under NCCL, waiting for the dead ones),
    reads the end and kills them once they had their grace to notice by themselves, longer
    when one of them did and is leaving. Its own node's end, or another attempt's, stops
    nothing."""
    group, rendezvous = _agents_view(monkeypatch, node=1)
    clock = [1000.0]
    monkeypatch.setattr(launcher.time, "monotonic", lambda: clock[0])
    killed = []
    agent = SimpleNamespace(_shutdown=killed.append)
    watch = launcher._Watch(None)

    def look(node: int, port: int = 29501):
        group.group_rank, group.master_port = node, port
        launcher._stop_if_the_job_ended(agent, group, watch, str(tmp_path))

    end = _end(0, causes="rank 0 was killed by SIGKILL")
    _put(rendezvous, "titan/end/job7", json.dumps(end))
    look(0)  # its own node's end
    clock[0] += launcher._END_POLL_S
    look(1, port=29502)  # another attempt's
    assert watch.ended is None and not killed
    clock[0] += launcher._END_POLL_S
    look(1)
    assert watch.ended == end and not killed  # read; the ranks have their grace
    clock[0] += launcher._END_GRACE_S
    with pytest.raises(launcher._EndedElsewhere) as stopped:
        look(1)
    assert killed == [signal.SIGKILL] and stopped.value.ranks == [2, 3]

    # A rank here noticed and said why (its record): it has longer to leave by itself.
    monkeypatch.setenv(failure_records.FAILURE_DIR_ENV, str(tmp_path))
    failure_records.write_record("crash-rank", _crash(0) | {"copied_by": 2}, rank=0)
    watch, killed[:] = launcher._Watch(None), []
    look(1)
    clock[0] += launcher._END_GRACE_S
    look(1)
    assert not killed
    clock[0] += launcher._END_LEAVE_S
    with pytest.raises(launcher._EndedElsewhere):
        look(1)


def test_once_the_job_ended_elsewhere_the_agent_neither_restarts_nor_waits(
    monkeypatch, tmp_path, capsys
):
    """Through the agent's methods as the launcher wraps them: ranks that failed after another
    node ended the job are not restarted (no restart line, no restart left); torchrun's own
    stop of the ranks, and a restart asked by a third node, kill them without SIGTERM; ranks
    that still run are stopped once the end is read and their grace is over."""
    LocalElasticAgent = _keep_agent_methods(monkeypatch)
    group, rendezvous = _agents_view(monkeypatch, node=1)
    monkeypatch.setattr(launcher, "_LINGER_S", 0.0)
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    results = []
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda a, g: results.pop(0))
    signals = []
    monkeypatch.setattr(
        LocalElasticAgent, "_shutdown", lambda a, sig=None, *args: signals.append(sig)
    )
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda a, g: None)
    monkeypatch.setattr(LocalElasticAgent, "_start_workers", lambda a, g: None)
    watch = launcher._watch_agent(str(tmp_path), None)
    agent = SimpleNamespace(_remaining_restarts=1)
    agent._shutdown = lambda sig=signal.SIGTERM: LocalElasticAgent._shutdown(agent, sig)

    _put(rendezvous, "titan/end/job7", json.dumps(_end(0, causes="rank 0 was killed by SIGKILL")))
    lost = {2: _Failure(failure_records.LOST_PEER_EXIT_CODE)}
    results.append(RunResult(state=WorkerState.FAILED, failures=lost))
    LocalElasticAgent._monitor_workers(agent, group)
    assert agent._remaining_restarts == 0 and watch.ended is not None
    assert "restart" not in capsys.readouterr().err
    LocalElasticAgent._shutdown(agent)  # torchrun stops the ranks
    with pytest.raises(launcher._EndedElsewhere):
        LocalElasticAgent._restart_workers(agent, group)  # a third node came back
    assert signals == [signal.SIGKILL, signal.SIGKILL]

    LocalElasticAgent._start_workers(agent, group)  # a new attempt forgets the end
    assert watch.ended is None
    LocalElasticAgent._shutdown(agent)
    assert signals[-1] == signal.SIGTERM  # no end read: a preemption or scale-up saves first
    clock = [1000.0]
    monkeypatch.setattr(launcher.time, "monotonic", lambda: clock[0])
    results.extend([RunResult(state=WorkerState.HEALTHY)] * 2)
    LocalElasticAgent._monitor_workers(agent, group)  # reads the end; the grace begins
    clock[0] += launcher._END_GRACE_S
    with pytest.raises(launcher._EndedElsewhere):
        LocalElasticAgent._monitor_workers(agent, group)
    assert signals[-1] == signal.SIGKILL


def test_a_node_stopped_by_another_nodes_end_names_it(capsys):
    """Another node's crash as a rank here would have copied it; a kill there with that
    node's line and host; a refusal as its one line, with its exit code."""
    crash = {k: v for k, v in _crash(1).items() if k != "traceback"}
    killed = _end(0, causes="rank 1 was killed by SIGKILL")
    assert launcher._print_ended_elsewhere(_end(0, crashes=[crash]), [2, 3]) == 1
    assert launcher._print_ended_elsewhere(killed, [2]) == 1
    assert launcher._print_ended_elsewhere(killed, None) == 1
    refusal = {"rank": 1, "code": 2, "message": "rank 1's data is empty", "time": 1.0}
    assert launcher._print_ended_elsewhere(_end(0, refusal=refusal), [2]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "[launcher] the job failed: rank 1, on node-b, raised ValueError: boom (traceback in "
        "logs/run/rank1.log there); ranks 2, 3, still running on this node, were stopped",
        "[launcher] the job failed: on node-b, rank 1 was killed by SIGKILL; rank 2, still "
        "running on this node, was stopped",
        "[launcher] the job failed: on node-b, rank 1 was killed by SIGKILL",
        "[rank1] error: rank 1's data is empty",
    ]


def test_ranks_that_only_lost_another_nodes_are_told_its_failure(monkeypatch, tmp_path, capsys):
    """Through the agent's methods as the launcher wraps them: this node's ranks only lost a
    rank of another node (their exit code says so, no record here), killed there, so no rank
    here could copy why: the restart names the kill from that node's agent's record for this
    attempt, then the ranks that only followed it. Another attempt's record, or none (a network
    fault), leaves this node's own line, after a bounded wait; a refusal there is not retried,
    and the launcher prints it with its exit code."""
    LocalElasticAgent = _keep_agent_methods(monkeypatch)
    group, rendezvous = _agents_view(monkeypatch, node=1)
    monkeypatch.setattr(launcher, "_THERE_WAIT_S", 0.3)
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    results = []
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda a, g: results.pop(0))
    monkeypatch.setattr(LocalElasticAgent, "_start_workers", lambda a, g: None)
    watch = launcher._watch_agent(str(tmp_path), None)
    group.spec.max_restarts = 2
    agent = SimpleNamespace(_remaining_restarts=2)
    lost = {r: _Failure(failure_records.LOST_PEER_EXIT_CODE) for r in (2, 3)}

    def fail() -> None:
        results.append(RunResult(state=WorkerState.FAILED, failures=lost))
        LocalElasticAgent._monitor_workers(agent, group)

    crash = {k: v for k, v in _crash(1).items() if k != "traceback"}
    assert failure_report.causes(lost, [], _end(0, crashes=[crash])) == (
        "rank 1, on node-b, raised ValueError: boom (traceback in logs/run/rank1.log there) "
        "(then ranks 2, 3 lost contact and stopped)"
    )
    killed = _end(0, causes="rank 1 was killed by SIGKILL")
    _put(rendezvous, "titan/failed/job7/10.0.0.1:29501", json.dumps(killed))
    fail()
    start = time.monotonic()
    group.master_port = 29502  # the next attempt: no record of it
    agent._remaining_restarts -= 1  # as torchrun counts
    LocalElasticAgent._start_workers(agent, group)
    assert watch.there is None
    fail()
    assert time.monotonic() - start >= launcher._THERE_WAIT_S
    assert capsys.readouterr().err.splitlines() == [
        "[launcher] restart 1 of 2: on node-b, rank 1 was killed by SIGKILL (then ranks 2, 3 "
        "lost contact and stopped); restarting every rank from the last complete checkpoint",
        "[launcher] restart 2 of 2: rank 2 exited with code 4 (a collective lost another "
        "rank); rank 3 exited with code 4 (a collective lost another rank); restarting every "
        "rank from the last complete checkpoint",
    ]
    # Ranks that only lost others publish nothing.
    assert (
        job_store.failure_of_attempt(f"127.0.0.1:{rendezvous.port}", "job7", "10.0.0.1:29502")
        is None
    )

    # That node had no restart left (this one has one): its failure and the job's end are
    # published together, after this agent's first look for an end, during its wait.
    group.master_port = 29505
    LocalElasticAgent._start_workers(agent, group)
    ended = _end(0, master="10.0.0.1:29505", causes="rank 1 was killed by SIGKILL")

    def publish() -> None:
        for key in ("titan/failed/job7/10.0.0.1:29505", "titan/end/job7"):
            _put(rendezvous, key, json.dumps(ended))

    monkeypatch.setattr(launcher, "_THERE_WAIT_S", 2.0)
    threading.Timer(0.5, publish).start()
    fail()
    assert watch.ended == watch.there == ended and agent._remaining_restarts == 0
    assert capsys.readouterr().err == ""  # no restart: the job ended there

    # Without the store (the static rendezvous) nothing is waited for; a crash a rank of this
    # node published is not another node's.
    group.master_port = 29506
    monkeypatch.delenv(job_store.JOB_STORE_ENV)
    start = time.monotonic()
    assert other_nodes.failure_elsewhere(group, 5.0) is None
    assert time.monotonic() - start < 1.0
    monkeypatch.setenv(job_store.JOB_STORE_ENV, f"127.0.0.1:{rendezvous.port}")
    for rank in (3, 1):
        published = crash | {"rank": rank, "time": time.time()}
        _put(rendezvous, "titan/crash/job7/10.0.0.1:29506", json.dumps(published))
        found = other_nodes.failure_elsewhere(group, 0.0)
        assert found == (None if rank == 3 else {"crashes": [published]})
        rendezvous.delete_key("titan/crash/job7/10.0.0.1:29506")

    # A refusal there, that no rank here read: not retried, printed as its one line.
    refusal = {"rank": 1, "code": 2, "message": "rank 1's data is empty", "time": 1.0}
    group.master_port = 29503
    LocalElasticAgent._start_workers(agent, group)
    there = _end(0, master="10.0.0.1:29503", causes="C", refusal=refusal)
    _put(rendezvous, "titan/failed/job7/10.0.0.1:29503", json.dumps(there))
    agent._remaining_restarts = 1
    fail()
    assert agent._remaining_restarts == 0 and capsys.readouterr().err == ""

    def run(args):
        failed = ChildFailedError.__new__(ChildFailedError)  # what torchrun raises, unformatted
        failed.failures = lost
        raise failed

    _keep_what_main_sets(monkeypatch)
    monkeypatch.setattr("torch.distributed.run.run", run)
    monkeypatch.setattr(launcher, "_watch_agent", lambda folder, shown: watch)
    assert launcher.main(["--nproc_per_node", "2", "train.py"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "[rank1] error: rank 1's data is empty"

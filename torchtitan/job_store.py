"""The job's first refusal, an attempt's first crash, and a node's failure and the job's end,
shared across nodes through a store every rank reaches.

Each node's launcher collects its own ranks' records in a folder (``failure_records.py``). A
rank of another node only sees its peer go away; it reads the record here and hands it to its
own launcher, so every node names the same cause (and none restarts after a refusal). The
launchers themselves say in the c10d rendezvous's store why their ranks failed in an attempt,
and whether that ends the job (``other_nodes.py``): another node's ranks may never see theirs
go away (under NCCL they can wait in a collective until its timeout), and their launcher, which
keeps a client of that store, stops them.

The store is the c10d rendezvous's (``JOB_STORE_ENV``, ``host:port``, set by the launcher from
``--rdzv_endpoint``: hosted by one node's agent for the whole job), else the one torchrun's
ranks meet in (``MASTER_ADDR:MASTER_PORT``: the first node's agent's under the static
rendezvous; under c10d with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which the launcher sets
with restarts on, rank 0's own, which goes with rank 0). One node's job never uses it: its
folder is enough.

Every exchange is bounded: ``TCPStore``'s client blocks without end on an address that accepts
connections but never answers, so the exchange runs in a daemon thread given
``_DEADLINE_S``. c10d's C++ logger writes its connection retries and failures to stderr, in a
process that is about to say why it stops in one line: file descriptor 2 goes to /dev/null
while the exchange runs, for every thread of the process (a C++ line of another thread in that
window is lost; Python's loggers write to the log file as well).

torch is imported inside the functions: the launcher imports this module without it.
"""

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

JOB_STORE_ENV = "TITAN_JOB_STORE"
ATTEMPT_ENV = "TITAN_ATTEMPT"  # the attempt's name, alike on every node (attempt_name)
_TIMEOUT_S = 2.0  # the client's own timeout; it retries a failed connection for about twice that
_DEADLINE_S = 3 * _TIMEOUT_S
_NAME_ASKS = 3  # attempt_name's
_clients: dict[tuple[str, int], Any] = {}  # an agent's, kept (_exchange's keep)
# What a rank publishes, by kind, with the fields a record read back must have.
_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "refusal": {"rank": int, "code": int, "message": str, "time": (int, float)},
    "crash": {"rank": int, "error": str, "host": str, "time": (int, float)},
}
# What an agent publishes when its ranks failed: its node (group rank), host, the attempt's
# ``MASTER_ADDR:MASTER_PORT`` (and name: ``other_nodes.attempt``), its line of causes and the
# crash records behind it.
_NODE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "node": int,
    "host": str,
    "master": str,
    "causes": str,
    "crashes": list,
    "time": (int, float),
}


def key(kind: str) -> str:
    """One key per kind, torchrun run (``--rdzv_id``) and, for a crash, attempt: another job at
    the same address reads its own, and a restarted attempt not an earlier one's. An attempt
    is where its ranks meet (``MASTER_ADDR:MASTER_PORT``: a port of its own per attempt under
    c10d with restarts on, see the launcher, but a port can come again), plus the attempt's
    name under c10d (:func:`attempt_name`, in ``ATTEMPT_ENV``), or the restart count under the
    static rendezvous, which shares one port (there every node counts alike; under c10d a node
    restarts without counting when another comes back)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if kind == "refusal":
        return f"titan/refusal/{run}"
    attempt = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    if name := os.environ.get(ATTEMPT_ENV):
        attempt += f"/{name}"
    elif not os.environ.get(JOB_STORE_ENV):
        attempt += f"/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return _crash_key(run, attempt)


def attempt_name(round_store: Any) -> str | None:
    """A name for this attempt that every node's agent reads alike, so that no node compares
    its clock with another's to tell attempts apart: the first agent's random name, set in
    ``round_store``, the rendezvous round's own store (torchrun's ``worker_group.store`` under
    c10d: another round, another prefix of its keys). Asked up to three times: a node left
    without a name while the others have one would publish where they do not look (and an
    answer lost after the store took this node's name is read back by the next ask). None when
    the store does not answer."""
    mine = uuid.uuid4().hex[:12]
    for _ in range(_NAME_ASKS):
        done, name = _bounded(lambda: round_store.compare_set("titan/attempt", "", mine), False)
        if done and isinstance(name, bytes) and name:
            return name.decode()
    return None


def _crash_key(run: str, attempt: str) -> str:
    return f"titan/crash/{run}/{attempt}"


def crash_of_attempt(rendezvous: str, run: str, master: str) -> dict | None:
    """For an agent (which has no rank's environment): the crash a rank published in the c10d
    rendezvous's store (``rendezvous``, ``host:port``) in the attempt of torchrun run ``run``
    whose ranks meet at ``master`` (``addr:port``), if any."""
    return _agent_read(rendezvous, _crash_key(run, master), _checked_crash)


def publish_failure(rendezvous: str, run: str, record: dict, *, final: bool) -> None:
    """For an agent whose ranks failed with a cause of their own: ``record`` (``_NODE_FIELDS``;
    a refusal's record under ``refusal``) as the failure of its attempt (``record["master"]``),
    and with ``final`` (no restart left, or a refusal) as the job's end, in the c10d
    rendezvous's store, unless another node's agent was first. The agents of nodes whose ranks
    still run, waiting in a collective for ranks that are gone (NCCL's, which can wait until
    their timeout), read it there (:func:`failure_of_attempt`, :func:`end_of_job`)."""
    text = json.dumps(record)

    def write(store) -> None:
        store.compare_set(_failure_key(run, record["master"]), "", text)
        if final:
            store.compare_set(_end_key(run), "", text)

    _agent_exchange(write, rendezvous)


def failure_of_attempt(rendezvous: str, run: str, master: str) -> dict | None:
    """The first failure an agent published for the attempt whose ranks meet at ``master``."""
    return _agent_read(rendezvous, _failure_key(run, master), _checked_node_record)


def end_of_job(rendezvous: str, run: str) -> dict | None:
    """The job's end, if an agent published one (:func:`publish_failure` with ``final``)."""
    return _agent_read(rendezvous, _end_key(run), _checked_node_record)


def _failure_key(run: str, master: str) -> str:
    return f"titan/failed/{run}/{master}"


def _end_key(run: str) -> str:
    return f"titan/end/{run}"


def _checked_crash(record: Any) -> bool:
    return _has(record, _FIELDS["crash"])


def _checked_node_record(record: Any) -> bool:
    if not _has(record, _NODE_FIELDS):
        return False
    refusal = record.get("refusal")
    return all(map(_checked_crash, record["crashes"])) and (
        refusal is None or _has(refusal, _FIELDS["refusal"])
    )


def _agent_read(rendezvous: str, record_key: str, check: Callable[[Any], bool]) -> dict | None:
    return _agent_exchange(lambda store: _checked(store, record_key, check), rendezvous)


def _agent_exchange(use: Callable[[Any], Any], rendezvous: str) -> Any:
    """``use(store)`` for an agent, with the client of the rendezvous's store it keeps (it
    looks every second while its ranks run: one connection, not one per look). Not quiet: an
    agent's stderr carries its ranks' lines."""
    addr, _, port = rendezvous.rpartition(":")
    if not (addr and port.isdigit()):
        return None
    return _exchange(use, (addr, int(port)), quiet=False, keep=True)


def publish(kind: str, record: dict) -> None:
    """``record`` as the job's ``kind`` (``refusal`` or ``crash``), unless a rank was first."""
    _exchange(lambda store: store.compare_set(key(kind), "", json.dumps(record)), _address())


def published() -> dict[str, dict]:
    """The job's first refusal and first crash, by kind, as far as ranks published them (each
    record checked: a malformed one is left out)."""

    def read(store) -> dict[str, dict]:
        records = {
            kind: _checked(store, key(kind), lambda r, fields=fields: _has(r, fields))
            for kind, fields in _FIELDS.items()
        }
        return {kind: record for kind, record in records.items() if record is not None}

    return _exchange(read, _address()) or {}


def _checked(store, record_key: str, check: Callable[[Any], bool]) -> dict | None:
    """The record under ``record_key``, if there is one and ``check`` passes it."""
    if not store.check([record_key]):
        return None
    try:
        record = json.loads(store.get(record_key))
    except ValueError:
        return None
    return record if check(record) else None


def _has(record: Any, fields: dict) -> bool:
    """Whether ``record`` is a dict with ``fields`` of their types."""
    return isinstance(record, dict) and all(isinstance(record.get(k), t) for k, t in fields.items())


def _address() -> tuple[str, int] | None:
    """Where the job's store is, or None: one node, no store yet, or a malformed address."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        return None  # one node
    if rendezvous := os.environ.get(JOB_STORE_ENV):
        addr, _, port = rendezvous.rpartition(":")
    else:
        import torch.distributed as dist

        addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        # Rank 0 hosts an unshared store only once its process group is made.
        shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        if not (shared or (dist.is_available() and dist.is_initialized())):
            return None
    return (addr, int(port)) if addr and port.isdigit() else None


def _exchange(
    use: Callable[[Any], Any],
    address: tuple[str, int] | None,
    *,
    quiet: bool = True,
    keep: bool = False,
) -> Any:
    """``use(store)`` with a client of the store at ``address``, within ``_DEADLINE_S`` (with
    ``quiet``, stderr silenced meanwhile; with ``keep``, the client kept for the next exchange
    with that address, and a fresh one tried when the kept one fails); None when there is no
    store, it is gone, or it does not answer."""
    if address is None:
        return None
    kept = _clients.pop(address, None) if keep else None
    if kept is not None:
        done, result = _bounded(lambda: use(kept), quiet)
        if done:
            _clients[address] = kept
            return result
    try:  # a refused connection fails here at once; TCPStore would retry it until its timeout
        socket.create_connection(address, timeout=_TIMEOUT_S).close()
    except OSError:
        return None
    made: list[Any] = []

    def fresh() -> Any:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=_TIMEOUT_S)
        made.append(dist.TCPStore(*address, is_master=False, timeout=timeout))
        return use(made[0])

    done, result = _bounded(fresh, quiet)
    if done and keep:
        _clients[address] = made[0]
    return result


def _bounded(call: Callable[[], Any], quiet: bool) -> tuple[bool, Any]:
    """``call()`` in a daemon thread given ``_DEADLINE_S``: whether it returned in time, and
    what it returned (None when it raised a ``DistError`` or read a bad record)."""
    result: list[Any] = [None]
    done = threading.Event()

    def run() -> None:
        try:
            result[0] = call()
            done.set()
        except (RuntimeError, ValueError):  # DistError (a RuntimeError), a bad record
            pass

    with _stderr_silenced() if quiet else contextlib.nullcontext():
        thread = threading.Thread(target=run, name="titan-job-store", daemon=True)
        thread.start()
        thread.join(_DEADLINE_S)
    return done.is_set(), result[0]


@contextlib.contextmanager
def _stderr_silenced():
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)

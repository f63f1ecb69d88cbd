"""One run at a time in a dump folder. A second run started into a folder where one still runs
would set the first's records aside under it, write into the same metrics, and replace its
checkpoints step by step (each warning of it); it is refused instead, naming the running one.
The checkpoint folder a run saves into is locked alike (``config.folders.locked_folders``): two
runs of their own dump folders may name the same one.

Rank 0 holds a POSIX record lock on ``<dump_folder>/.titan-run.lock`` while its run lives: the
kernel drops it when the process ends however it ends (a kill, a crash), so a restarted or
requeued run takes it again; a dataloader worker forked from rank 0 does not inherit it. The
launch's pre-flight looks for a holder before any rank starts (a run started by torchrun
directly is refused by its rank 0). The lock says which job held it: a lock of this job's own
earlier attempt that outlives it (a crashed node's, until the file server lets it go) is
waited for, then run past with a warning, never refused. NFS v4 and Lustre mounted with
``flock`` carry the lock between nodes; mounts that keep locks on the node (NFS ``nolock`` or
``local_lock``, Lustre ``localflock``) refuse only a second run on the same node; where the
file system has no locks the run goes on unlocked, with a warning. A POSIX lock belongs to its
process, and closing any of its descriptors of the file drops it: rank 0 opens the file once
(the pre-flight, which looks, is another process). No torch import here.
"""

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError

LOCK_FILE = ".titan-run.lock"

_TAKE_WAIT_S = 3.0  # a restart's rank 0 may come up while the old one's lock is being dropped
_OWN_JOB_WAIT_S = 30.0  # this job's earlier attempt's lock, kept by a file server after a crash
_JOB_ENV = ("SLURM_JOB_ID", "TITAN_RUN_ID")  # the same over a requeue / over torchrun restarts


class RunLock:
    """The lock of a dump folder, held until :meth:`release` or the process ends."""

    def __init__(self, fd: int | None, path: Path):
        self._fd, self.path = fd, path

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


def holder(dump_folder: str | Path) -> dict[str, Any] | None:
    """The record of the run holding the dump folder's lock (``{}`` when it has not written
    it yet), or None when nobody holds it or the file system has no locks."""
    path = Path(dump_folder) / LOCK_FILE
    try:  # read-only and a shared lock: the file may be another user's in a shared folder
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None  # no lock file: no run ever held it
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held
        return _record(path)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def check_free(dump_folder: str | Path, *, flag: str = "--job.dump_folder") -> None:
    """The launch's look: raise :class:`InUse` when another run holds the folder (not this
    job's own earlier attempt, which rank 0 waits for); ``flag`` names the folder."""
    record = holder(dump_folder)
    if record is not None and not _this_jobs(record):
        raise InUse(dump_folder, record, flag=flag)


def take(
    dump_folder: str | Path, *, warn, wait_s: float | None = None, flag: str = "--job.dump_folder"
) -> RunLock:
    """The dump folder's lock, for this process's run, waiting up to ``wait_s`` (about 3 s by
    default; 30 s for a lock of this job's earlier attempt) for a holder to let go. Raises
    :class:`InUse` naming another run's holder after that; past this job's own, and where
    the file system cannot lock, ``warn(line)`` is told and the run goes on unlocked."""
    path = Path(dump_folder) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # others' runs may look (umask)
    except OSError as e:  # a lock file of another user's
        return _unlocked(path, f"cannot lock {path} ({e.strerror})", warn)
    started = time.monotonic()
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held
            record = _record(path)
            own = _this_jobs(record)
            limit = _TAKE_WAIT_S if wait_s is None else wait_s
            if time.monotonic() - started >= (max(limit, _OWN_JOB_WAIT_S) if own else limit):
                os.close(fd)
                if not own:
                    raise InUse(dump_folder, record, flag=flag) from None
                return _unlocked(
                    path, f"{path} is still locked by this job's earlier attempt "
                    f"({_described(record)}), which has ended: a crashed node's lock kept by "
                    "the file server", warn,
                )  # fmt: skip
            time.sleep(0.2)
        except OSError as e:  # a file system without locks
            os.close(fd)
            return _unlocked(path, f"cannot lock {path} ({e.strerror})", warn)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    record |= {name: os.environ[name] for name in _JOB_ENV if os.environ.get(name)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
    return RunLock(fd, path)


class InUse(ConfigError):
    """Another run holds the dump folder's lock (exit code 2, one line)."""

    def __init__(
        self, dump_folder: str | Path, record: dict[str, Any], *, flag: str = "--job.dump_folder"
    ):
        lock = Path(dump_folder) / LOCK_FILE
        super().__init__(
            f"{flag} {dump_folder}: another run is using it ({_described(record)}); wait for "
            f"it to end, stop it, or choose another {flag} (if that process is gone with a "
            f"crashed node, remove {lock})"
        )


def _unlocked(path: Path, why: str, warn) -> RunLock:
    warn(f"{why}: running without it (a second run started into this folder is not refused)")
    return RunLock(None, path)


def _this_jobs(record: dict[str, Any]) -> bool:
    """Whether the holder is this job's earlier attempt (the same Slurm job, requeued, or the
    same launch, restarted by torchrun): ended, whatever its lock says."""
    return any(record.get(name) and record[name] == os.environ.get(name) for name in _JOB_ENV)


def _record(path: Path) -> dict[str, Any]:
    """The holder's record (written after it took the lock: may be missing a moment)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _described(record: dict[str, Any]) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["since"])))
        return f"pid {int(record['pid'])} on host {record['host']}, since {since}"
    except (KeyError, TypeError, ValueError):
        return "a process that has not said which yet"

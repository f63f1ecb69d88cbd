"""One run at a time in a dump folder. A second run started into a folder where one still runs
would set the first's records aside under it, write into the same metrics, and replace its
checkpoints step by step (each warning of it); it is refused instead, naming the running one.

Rank 0 holds a POSIX record lock on ``<dump_folder>/.titan-run.lock`` while its run lives: the
kernel drops it when the process ends however it ends (a kill, a crash), so a restarted or
requeued run takes it again; a dataloader worker forked from rank 0 does not inherit it. The
launch's pre-flight looks for a holder before any rank starts. NFS v4 and Lustre (mounted with
``flock``) carry these locks between nodes; where the file system has none, the run goes on
unlocked, with a warning. A POSIX lock belongs to its process, and closing any of its
descriptors of the file drops it: rank 0 opens the file once (the pre-flight, which looks, is
another process). No torch import here.
"""

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from torchtitan.config.errors import ConfigError

LOCK_FILE = ".titan-run.lock"

_TAKE_WAIT_S = 3.0  # a restart's rank 0 may come up while the old one's lock is being dropped


class RunLock:
    """The lock of a dump folder, held until :meth:`release` or the process ends."""

    def __init__(self, fd: int | None, path: Path):
        self._fd, self.path = fd, path

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


def holder(dump_folder: str | Path) -> str | None:
    """Who holds the dump folder's lock (``pid P on host H since T``), or None when nobody
    does, or the file system has no locks. Takes the lock for a moment where it is free."""
    path = Path(dump_folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None  # no lock file: no run ever held it (or not one this user can take)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held
        return _described(path)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def take(dump_folder: str | Path, *, warn, wait_s: float | None = None) -> RunLock:
    """The dump folder's lock, for this process's run, waiting up to ``wait_s`` for a holder
    to let go (about 3 s by default); raises :class:`InUse` naming the holder after that. ``warn(line)`` is told when
    the file system cannot lock (the run goes on without it)."""
    path = Path(dump_folder) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a lock file of another user's
        return _unlocked(path, e, warn)
    deadline = time.monotonic() + (_TAKE_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held
            if time.monotonic() >= deadline:
                os.close(fd)
                raise InUse(dump_folder, _described(path)) from None
            time.sleep(0.2)
        except OSError as e:  # a file system without locks
            os.close(fd)
            return _unlocked(path, e, warn)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
    return RunLock(fd, path)


def _unlocked(path: Path, error: OSError, warn) -> RunLock:
    warn(
        f"cannot lock {path} ({error.strerror}): a second run started into this dump folder "
        "while this one runs would not be refused"
    )
    return RunLock(None, path)


class InUse(ConfigError):
    """Another run holds the dump folder's lock (exit code 2, one line)."""

    def __init__(self, dump_folder: str | Path, who: str):
        super().__init__(
            f"--job.dump_folder {dump_folder}: another run is using it ({who}); wait for it "
            "to end, stop it, or choose another --job.dump_folder"
        )


def _described(path: Path) -> str:
    """The holder as its record says (written after it took the lock: may be a moment old)."""
    try:
        record = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["since"])))
        return f"pid {int(record['pid'])} on host {record['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said which yet"

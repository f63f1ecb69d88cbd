"""One run at a time in a dump folder: a second run is refused naming the running one, before
launch and by rank 0; the lock goes with its process however it ends, and a process forked
from it (a dataloader worker) does not keep it."""

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan.components import run_lock
from torchtitan.config.errors import ConfigError
from torchtitan.train import main

SMALL = ["--training.steps", "1", "--model.flavor", "debugmodel"]

# Takes the lock, forks a child that outlives it (as a dataloader worker may a killed rank 0),
# says both pids, then waits.
_HOLDER = """
import os, sys, time
from torchtitan.components import run_lock
lock = run_lock.take(sys.argv[1], warn=print, wait_s=0)
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(os.getpid(), child, flush=True)
time.sleep(60)
"""


def _hold(folder: Path) -> tuple[subprocess.Popen, int]:
    """A process holding ``folder``'s lock, and the pid of its forked child."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE, text=True
    )
    pid, child = map(int, holder.stdout.readline().split())
    assert pid == holder.pid
    return holder, child


def test_a_held_folder_is_refused_naming_the_holder_and_freed_when_it_dies(tmp_path):
    holder, child = _hold(tmp_path)
    try:
        who = f"pid {holder.pid} on host {socket.gethostname()}, since "
        assert who in run_lock.holder(tmp_path)
        started = time.monotonic()
        with pytest.raises(ConfigError, match="another run is using it") as refused:
            run_lock.take(tmp_path, warn=pytest.fail, wait_s=0.5)
        assert time.monotonic() - started >= 0.5  # it waited for the holder to let go
        assert str(refused.value).startswith(f"--job.dump_folder {tmp_path}: another run")
        assert who in str(refused.value)
        holder.kill()  # SIGKILL: no code of the holder runs
        holder.wait()
        assert run_lock.holder(tmp_path) is None  # while its forked child still lives
        assert _alive(child)
        lock = run_lock.take(tmp_path, warn=pytest.fail, wait_s=0)
        assert f"pid {os.getpid()}" in run_lock._described(lock.path)
        lock.release()
    finally:
        holder.kill()
        _kill(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_folder_never_locked_or_free_has_no_holder(tmp_path):
    assert run_lock.holder(tmp_path / "missing") is None
    assert run_lock.holder(tmp_path) is None
    lock = run_lock.take(tmp_path / "new", warn=pytest.fail)  # made where missing
    lock.release()
    assert run_lock.holder(tmp_path / "new") is None


def test_a_file_system_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "lockf", no_locks)
    warnings: list[str] = []
    lock = run_lock.take(tmp_path, warn=warnings.append)
    lock.release()
    assert len(warnings) == 1 and "(No locks available): a second run" in warnings[0]
    assert run_lock.holder(tmp_path) is None


def test_the_launch_and_rank_0_refuse_a_held_folder(tmp_path, monkeypatch, capfd):
    """The pre-flight refuses before any rank starts; rank 0 (here without the pre-flight)
    exits 2 with the same line; a validation of saved weights runs beside the holder."""
    from torchtitan.config.manager import parse_args
    from torchtitan.config.validation import validate_launch

    holder, child = _hold(tmp_path)
    try:
        flags = [*SMALL, "--job.dump_folder", str(tmp_path)]
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on host"):
            validate_launch(parse_args(flags, console_outputs=False))
        only = ["--validation.enable", "--validation.only", "--validation.steps", "1"]
        validate_launch(parse_args([*flags, *only], console_outputs=False))
        monkeypatch.setattr(run_lock, "_TAKE_WAIT_S", 0.2)
        assert main(flags) == 2
        assert f"another run is using it (pid {holder.pid} on host" in capfd.readouterr().err
        assert not (tmp_path / "earlier_runs").exists() and not (tmp_path / "config.toml").exists()
    finally:
        holder.kill()
        _kill(child)

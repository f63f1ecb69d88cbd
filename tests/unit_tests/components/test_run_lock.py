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


def _hold(folder: Path, **env: str) -> tuple[subprocess.Popen, int]:
    """A process holding ``folder``'s lock (with ``env``), and the pid of its forked child."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "TITAN_RUN_ID")}
        | env,
    )
    pid, child = map(int, holder.stdout.readline().split())
    assert pid == holder.pid
    return holder, child


def test_a_held_folder_is_refused_naming_the_holder_and_freed_when_it_dies(tmp_path):
    holder, child = _hold(tmp_path)
    try:
        who = f"pid {holder.pid} on host {socket.gethostname()}, since "
        assert run_lock.holder(tmp_path)["pid"] == holder.pid
        started = time.monotonic()
        with pytest.raises(ConfigError, match="another run is using it") as refused:
            run_lock.take(tmp_path, warn=pytest.fail, wait_s=0.5)
        assert time.monotonic() - started >= 0.5  # it waited for the holder to let go
        assert str(refused.value).startswith(f"--job.dump_folder {tmp_path}: another run")
        assert who in str(refused.value)
        assert str(refused.value).endswith(f"remove {tmp_path / run_lock.LOCK_FILE})")
        holder.kill()  # SIGKILL: no code of the holder runs
        holder.wait()
        assert run_lock.holder(tmp_path) is None  # while its forked child still lives
        assert _alive(child)
        lock = run_lock.take(tmp_path, warn=pytest.fail, wait_s=0)
        assert run_lock.holder(tmp_path) is None  # this process's own lock: seen by others
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
    assert len(warnings) == 1 and "(No locks available): running without it" in warnings[0]
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
        # Beside it, a validation of its saved weights runs, and leaves its save in progress.
        partial = tmp_path / "checkpoint" / "step-2.tmp"
        partial.mkdir(parents=True)
        assert main([*flags, *only, "--checkpoint.enable"]) == 0
        assert partial.is_dir() and (tmp_path / "validation_only.jsonl").is_file()
    finally:
        holder.kill()
        _kill(child)


def test_this_jobs_earlier_attempt_is_waited_for_then_run_past(tmp_path, monkeypatch):
    """A lock of the same Slurm job (requeued) or the same launch (restarted by torchrun) is
    one a file server kept after its node crashed: the launch does not refuse it, rank 0
    waits for it, then goes on unlocked with a warning. Another job's is refused."""
    holder, child = _hold(tmp_path, SLURM_JOB_ID="4242")
    try:
        monkeypatch.setattr(run_lock, "_OWN_JOB_WAIT_S", 0.5)
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        run_lock.check_free(tmp_path)
        warnings: list[str] = []
        started = time.monotonic()
        lock = run_lock.take(tmp_path, warn=warnings.append, wait_s=0)
        assert time.monotonic() - started >= 0.5
        lock.release()
        assert len(warnings) == 1 and "locked by this job's earlier attempt (pid " in warnings[0]
        monkeypatch.setenv("SLURM_JOB_ID", "4243")
        with pytest.raises(ConfigError, match="another run is using it"):
            run_lock.check_free(tmp_path)
        with pytest.raises(ConfigError, match="another run is using it"):
            run_lock.take(tmp_path, warn=pytest.fail, wait_s=0)
    finally:
        holder.kill()
        _kill(child)


def test_the_lock_is_held_through_a_run_with_saves_and_dataloader_workers(tmp_path, monkeypatch):
    """Seen from another process at the run's end: nothing the run did (its saves, a worker
    process, its reports) dropped it; and it is free once the run returns."""
    import torchtitan.train as train

    seen = []

    def look(dump_folder):
        code = (
            f"from torchtitan.components import run_lock; print(run_lock.holder({str(tmp_path)!r}))"
        )
        seen.append(
            subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
        )

    monkeypatch.setattr(train, "_write_report", look)
    flags = [*SMALL, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "1"]
    assert main([*flags, "--training.num_workers", "1", "--job.dump_folder", str(tmp_path)]) == 0
    assert len(seen) == 1 and f"'pid': {os.getpid()}" in seen[0]
    assert run_lock.holder(tmp_path) is None


def test_a_checkpoint_folder_outside_the_dump_folder_is_locked_too(tmp_path, capfd):
    """Two runs of their own dump folders naming one checkpoint folder would remove each
    other's saves in progress and purge each other's steps: the second is refused, naming the
    flag. A run's default checkpoint folder, inside its dump folder, is locked as well (another
    run may name it)."""
    from torchtitan.config.folders import locked_folders
    from torchtitan.config.manager import parse_args

    shared = tmp_path / "shared_checkpoints"
    holder, child = _hold(shared)
    try:
        flags = [*SMALL, "--checkpoint.enable", "--checkpoint.folder", str(shared)]
        config = parse_args([*flags, "--job.dump_folder", str(tmp_path / "b")])
        assert [f for f, _ in locked_folders(config)] == [
            "--job.dump_folder",
            "--checkpoint.folder",
        ]
        assert main([*flags, "--job.dump_folder", str(tmp_path / "b")]) == 2
        assert f"--checkpoint.folder {shared}: another run is using it (pid {holder.pid}" in (
            capfd.readouterr().err
        )
        # Another run's default checkpoint folder, named by a run of its own dump folder.
        owner = parse_args([*SMALL, "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])
        [_, (_, theirs)] = locked_folders(owner)
        assert theirs == tmp_path / "checkpoint"
    finally:
        holder.kill()
        _kill(child)

"""The two-node Slurm cluster of ``tests/slurm/cluster.sh``, for integration tests.

A test takes the ``slurm_cluster`` fixture: it holds a lock for the test (pytest-xdist workers
run the Slurm tests one at a time), starts the cluster unless it is up (this process then
stops it at exit, under the lock) or skips the test with the script's one-line reason;
``submit``, ``wait``, ``signal`` and ``requeue`` drive jobs with sbatch, scontrol and
scancel. There is no accounting daemon: job states come from ``scontrol show job``, which
keeps finished jobs for a day (MinJobAge).
"""

import atexit
import contextlib
import fcntl
import re
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "tests" / "slurm" / "cluster.sh"
UNSUPPORTED = 3  # cluster.sh's exit code for "this machine cannot run the cluster"
FINISHED = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
     "PREEMPTED", "TIMEOUT"}
)  # fmt: skip


def _cluster(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLUSTER_SH), command], capture_output=True, text=True, timeout=120, check=False
    )


LOCK = Path("/tmp/torchtitan-slurm-tests.lock")


@contextlib.contextmanager
def _locked():
    """One user of the cluster at a time across processes (pytest-xdist workers)."""
    with LOCK.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_stops_at_exit = False


def _stop() -> None:
    with _locked():
        _cluster("down")


def _start() -> str | None:
    """Starts the cluster unless it is up; returns why it cannot run here, or None. Call it
    under ``_locked()``."""
    global _stops_at_exit
    if _cluster("status").returncode == 0:
        return None  # up already (cluster.sh up by hand, or another worker): leave it up
    up = _cluster("up")
    if up.returncode == UNSUPPORTED:
        return up.stderr.strip().splitlines()[-1]
    if up.returncode != 0:
        raise RuntimeError(f"{CLUSTER_SH} up failed:\n{up.stdout}{up.stderr}")
    if not _stops_at_exit:
        _stops_at_exit = True
        atexit.register(_stop)
    return None


@pytest.fixture
def slurm_cluster():
    """The cluster, up and this test's alone until it ends; or the test skipped, saying why."""
    with _locked():
        reason = _start()
        if reason is not None:
            pytest.skip(reason)
        yield


def submit(
    script: Path,
    *sbatch_args: str,
    script_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> int:
    """``sbatch [sbatch_args] script [script_args]``; the job inherits ``env`` (default: this
    process's)."""
    out = subprocess.run(
        ["sbatch", "--parsable", *sbatch_args, str(script), *script_args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.strip().split(";")[0])


def job(job_id: int) -> dict[str, str]:
    """Every ``Key=Value`` of ``scontrol show job`` (values with spaces are cut at them)."""
    line = subprocess.run(
        ["scontrol", "--oneliner", "show", "job", str(job_id)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(re.findall(r"(\S+?)=(\S*)", line))


def state(job_id: int) -> dict[str, str | int]:
    """``state`` (COMPLETED, FAILED, PENDING, ...), ``exit_code`` and ``signal`` of the batch
    script, ``restarts`` (SLURM_RESTART_COUNT of its last run), ``reason``."""
    fields = job(job_id)
    code, signal_number = fields["ExitCode"].split(":")
    return {
        "state": fields["JobState"],
        "exit_code": int(code),
        "signal": int(signal_number),
        "restarts": int(fields["Restarts"]),
        "reason": fields["Reason"],
    }


def wait(job_id: int, timeout: float, until: frozenset[str] = FINISHED) -> dict[str, str | int]:
    """Polls ``state(job_id)`` until its state is in ``until``; TimeoutError (naming the last
    state) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        now = state(job_id)
        if now["state"] in until:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {now} after {timeout}s")
        time.sleep(0.2)


def signal_job(job_id: int, name: str = "USR1", *, batch: bool = False, full: bool = False) -> None:
    """``scancel --signal=name``: by default to every process of every step (srun tasks and
    their children), not the batch shell; ``batch``: to the batch shell only; ``full``: to the
    batch shell, its children and every step."""
    flags = ["--batch"] * batch + ["--full"] * full
    subprocess.run(["scancel", f"--signal={name}", *flags, str(job_id)], check=True)


def requeue(job_id: int) -> None:
    """``scontrol requeue``: the job (running: its processes get SIGTERM; or finished) goes
    back to PENDING (Reason=BeginTime) under the same id and, about 11 s later, runs its batch
    script again with SLURM_RESTART_COUNT one higher."""
    subprocess.run(["scontrol", "requeue", str(job_id)], check=True)


def cancel(job_id: int) -> None:
    """``scancel``: SIGTERM to every process of the job, SIGKILL KillWait (5 s) later."""
    subprocess.run(["scancel", str(job_id)], check=True)

"""The two-node Slurm cluster of ``tests/slurm/cluster.sh``, for integration tests.

``require_cluster()`` starts it once per test session (and stops it at exit, unless it was up
before) or skips the test with the script's one-line reason; ``submit``, ``wait``, ``signal``
and ``requeue`` drive jobs with sbatch, scontrol and scancel. There is no accounting daemon:
job states come from ``scontrol show job``, which keeps finished jobs for a day (MinJobAge).
"""

import atexit
import functools
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


@functools.cache
def _start() -> str | None:
    """Starts the cluster unless it is up; returns why it cannot run here, or None."""
    if _cluster("status").returncode == 0:
        return None  # up already (someone ran cluster.sh up): use it, leave it up
    up = _cluster("up")
    if up.returncode == UNSUPPORTED:
        return up.stderr.strip().splitlines()[-1]
    if up.returncode != 0:
        raise RuntimeError(f"{CLUSTER_SH} up failed:\n{up.stdout}{up.stderr}")
    atexit.register(_cluster, "down")
    return None


def require_cluster() -> None:
    """Brings the cluster up (once per session) or skips the calling test, saying why."""
    reason = _start()
    if reason is not None:
        pytest.skip(reason)


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

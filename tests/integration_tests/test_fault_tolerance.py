"""Preemption and crash recovery on real 2-rank launches, each against one uninterrupted
``run_train.sh`` run of the same flags: a run stopped by SIGUSR1 (to the launcher) and by
SIGTERM (to one rank only) saves the step it stopped at, exits 75, and the same command resumes
it; with ``MAX_RESTARTS=1`` a rank killed with SIGKILL is restarted with the others from the
last checkpoint, and the job finishes by itself; ``multinode_trainer.slurm`` on the local
two-node Slurm cluster (a rank per node) is preempted by ``scancel --signal=USR1``, requeues
itself and resumes. Every step's loss is bitwise the uninterrupted run's (the last record of a
step redone after a crash)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import REPO, SMALL, clean_env, records, run_train
from slurm_cluster import signal_job, state, submit, wait

pytestmark = pytest.mark.integration

STEPS = 16
FLAGS = [
    "--debug.deterministic", "--checkpoint.enable", "--checkpoint.interval", "5",
    "--lr_scheduler.warmup_steps", "2", "--training.steps", str(STEPS),
]  # fmt: skip


def _losses(dump: Path) -> dict[int, float]:
    """Each step's loss; the last record wins (a step redone after a crash)."""
    return {r["step"]: r["loss"] for r in records(dump)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("uninterrupted")
    result = run_train(dump, *FLAGS, ngpu=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return _losses(dump)


def _start(dump: Path, *flags: str, session: bool = False, **env: str) -> subprocess.Popen:
    """``NGPU=2 ./run_train.sh``; its pid becomes the launcher's (the script ``exec``s it).
    ``session``: in a process group of its own, as a terminal's foreground job is."""
    return subprocess.Popen(
        ["./run_train.sh", *SMALL, "--job.dump_folder", str(dump), *FLAGS, *flags],
        cwd=REPO, env=clean_env(NGPU="2", **env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=session,
    )  # fmt: skip


def _last_logged(dump: Path) -> int:
    """The last step in ``metrics.jsonl`` so far (0: none; a line being written is skipped)."""
    path = dump / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return max(steps, default=0)


def _wait_for_step(dump: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if _last_logged(dump) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"no step {step} logged; the run said:\n{proc.communicate()[0][-3000:]}")


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of ``rank`` among the launcher's children (torchrun starts ranks directly)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} among the launcher's children {children}")


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    return out


def _events(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "events.jsonl").read_text().splitlines()]


def test_preempted_runs_save_their_step_and_resume_bitwise(tmp_path, uninterrupted):
    # SIGUSR1 to the launcher (as `scancel --signal=USR1` or a local `kill` sends it).
    proc = _start(tmp_path)
    _wait_for_step(tmp_path, 3, proc)
    proc.send_signal(signal.SIGUSR1)
    out = _finish(proc)
    assert proc.returncode == 75, out[-3000:]
    first = max(_losses(tmp_path))
    assert first < STEPS
    assert f"preempted by SIGUSR1 after step {first}" in out.splitlines()[-1]
    assert (tmp_path / "checkpoint" / f"step-{first}" / "manifest.json").is_file()

    # SIGTERM to rank 1 only: rank 0 learns of it in the same step and both save it.
    proc = _start(tmp_path)
    _wait_for_step(tmp_path, first + 2, proc)
    os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM)
    out = _finish(proc)
    assert proc.returncode == 75, out[-3000:]
    second = max(_losses(tmp_path))
    assert first < second < STEPS, (first, second)
    assert (tmp_path / "checkpoint" / f"step-{second}" / "manifest.json").is_file()

    done = run_train(tmp_path, *FLAGS, ngpu=2)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r["step"] for r in records(tmp_path)]
    assert steps == list(range(1, STEPS + 1))  # no step lost, none done twice
    assert _losses(tmp_path) == uninterrupted
    events = _events(tmp_path)
    assert [e["step"] for e in events if e["event"] == "start"] == [0, first, second]
    assert [(e["signal"], e["step"]) for e in events if e["event"] == "preempt"] == [
        ("SIGUSR1", first), ("SIGTERM", second)
    ]  # fmt: skip


def test_ctrl_c_stops_every_rank_in_one_line_each(tmp_path):
    """A terminal's Ctrl-C sends SIGINT to the launcher and every rank at once: each rank says
    so in one line (it was a KeyboardInterrupt traceback from wherever the step was), the
    launcher says nothing was saved, and the exit code is the shell's 130."""
    proc = _start(tmp_path, "--checkpoint.interval", "50", session=True, LOG_RANK="0,1")
    _wait_for_step(tmp_path, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out = _finish(proc)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "death signal" not in out, out[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}]: " in out
    lines = [line for line in out.splitlines() if "Interrupted (SIGINT, Ctrl-C)" in line]
    assert len(lines) == 2 and all("resumes from the last complete checkpoint" in x for x in lines)
    assert out.splitlines()[-1].startswith("[launcher] stopped by SIGINT: the ranks stopped")
    assert not any((tmp_path / "checkpoint").glob("step-*"))  # nothing saved (the lock aside)


def test_a_killed_rank_is_restarted_from_the_last_checkpoint(tmp_path, uninterrupted):
    proc = _start(tmp_path, "--metrics.report", MAX_RESTARTS="1")
    _wait_for_step(tmp_path, 7, proc)
    killed_at = time.time()
    os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "[launcher] restart 1 of 1: rank 1 was killed by SIGKILL" in out, out[-3000:]
    # Rank 0, whose collective lost rank 1, says so in a line (the cause comes first in the
    # launcher's), or was stopped by torchrun before it noticed: no traceback either way.
    assert "Traceback" not in out, out[-3000:]
    assert _losses(tmp_path) == uninterrupted
    restart = next(e for e in _events(tmp_path) if e["event"] == "start" and e["restart"])
    assert restart["step"] == 5  # the last complete checkpoint before the kill
    # The report of the whole job: both attempts, the crash counted.
    summary = (tmp_path / "report.txt").read_text()
    assert "1 after a crash" in summary and "finished at step 16" in summary
    assert (tmp_path / "report.png").stat().st_size > 10_000
    print(f"restart-to-start {restart['time'] - killed_at:.1f} s after the kill")


@pytest.mark.usefixtures("slurm_cluster")
def test_a_two_node_slurm_job_is_preempted_requeues_itself_and_resumes(tmp_path, uninterrupted):
    job = submit(
        REPO / "multinode_trainer.slurm", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
        f"--output={tmp_path}/slurm-%j.out",
        script_args=(*SMALL, "--job.dump_folder", str(tmp_path), *FLAGS),
        env=clean_env(CONFIG="llama3_debugmodel", NPROC_PER_NODE="1"), cwd=REPO,
    )  # fmt: skip
    log = tmp_path / f"slurm-{job}.out"
    deadline = time.monotonic() + 240
    while _last_logged(tmp_path) < 3:
        assert time.monotonic() < deadline and state(job)["state"] in ("PENDING", "RUNNING"), (
            log.read_text()[-3000:] if log.exists() else state(job)
        )
        time.sleep(0.1)
    signal_job(job, "USR1")  # to every process of the job's steps, as Slurm's --signal does
    wait(job, 120, until=frozenset({"PENDING"}))  # requeued by the script
    end = wait(job, 300)
    out = log.read_text()
    assert (end["state"], end["exit_code"], end["restarts"]) == ("COMPLETED", 0, 1), out[-3000:]
    assert "preempted with a checkpoint saved: requeueing it" in out
    steps = [r["step"] for r in records(tmp_path)]
    assert steps == list(range(1, STEPS + 1)), out[-3000:]
    assert _losses(tmp_path) == uninterrupted
    starts = [e for e in _events(tmp_path) if e["event"] == "start"]
    preempt = next(e for e in _events(tmp_path) if e["event"] == "preempt")
    assert [(e["step"], e["requeue"]) for e in starts] == [(0, 0), (preempt["step"], 1)]


def test_a_hung_rank_is_ended_by_the_watchdog_and_restarted(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan.launcher", "--nproc_per_node", "2", "--max-restarts",
         "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
         "tests/integration_tests/hang_harness.py", *SMALL, "--job.dump_folder", str(tmp_path),
         "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "5",
         "--comm.train_timeout_seconds", "5"],
        cwd=REPO, env=clean_env(HANG_RANK="1", HANG_STEP="3", HANG_ONCE="1"),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "[launcher] restart 1 of 1: " in out and "code 124 (the hang watchdog)" in out
    assert "[launcher] the hang: rank 1 was outside any communication, at tests/" in out
    assert (tmp_path / "comm_traces" / "rank1_stacks.txt").exists()
    starts = [e for e in _events(tmp_path) if e["event"] == "start"]
    assert [(e["step"], e["restart"]) for e in starts] == [(0, 0), (2, 1)]
    assert max(_losses(tmp_path)) == 5

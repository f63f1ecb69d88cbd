"""Time lost to a preemption and to a crash, on real 2-rank launches (``run_train.sh``).

    .venv/bin/python benchmarks/bench_fault_tolerance.py [--flavors debugmodel debug_100m]

For each flavor (FSDP 2, checkpointing on):
- preemption: SIGUSR1 to the launcher once step 3 is logged; seconds from the signal to the
  job's exit (the step in flight, the checkpoint write, shutdown), and that save's own time;
- crash: ``MAX_RESTARTS=1``, SIGKILL to rank 1 once step 3 is logged; seconds from the kill to
  the restarted run's start event and to its first logged step.
Prints one table. Run it on a quiet machine.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _launch(dump: Path, flavor: str, seq_len: int, **env: str) -> subprocess.Popen:
    flags = [
        "--model.flavor", flavor, "--training.seq_len", str(seq_len), "--training.steps", "200",
        "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--metrics.no_report",
        "--checkpoint.enable", "--checkpoint.interval", "2", "--job.dump_folder", str(dump),
    ]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    environ |= {"NGPU": "2", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, **env}
    return subprocess.Popen(
        ["./run_train.sh", *flags], cwd=REPO, env=environ, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(predicate, proc: subprocess.Popen, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.time()
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended early with {proc.returncode}")
        time.sleep(0.01)
    raise TimeoutError


def _rank_pid(launcher: int, rank: int) -> int:
    for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return int(pid)
    raise RuntimeError(f"no rank {rank}")


def preemption(flavor: str, seq_len: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp)
        proc = _launch(dump, flavor, seq_len)
        _wait(lambda: any(r["step"] >= 3 for r in _records(dump / "metrics.jsonl")), proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=900)
        seconds = time.monotonic() - sent
        if code != 75:
            raise RuntimeError(f"a preempted run exited with {code}, not 75")
        saves = [e for e in _records(dump / "events.jsonl") if e["event"] == "checkpoint"]
        return seconds, saves[-1]["seconds"]


def crash(flavor: str, seq_len: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp)
        proc = _launch(dump, flavor, seq_len, MAX_RESTARTS="1")
        metrics, events = dump / "metrics.jsonl", dump / "events.jsonl"
        _wait(lambda: any(r["step"] >= 3 for r in _records(metrics)), proc)
        logged = len(_records(metrics))
        killed = time.time()
        os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)
        _wait(lambda: any(e.get("restart") for e in _records(events)), proc)
        _wait(lambda: len(_records(metrics)) > logged, proc)
        start = next(e for e in _records(events) if e.get("restart"))["time"]
        first = _records(metrics)[logged]
        step_end = metrics.stat().st_mtime if first else time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=900)
        return start - killed, step_end - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavors", nargs="+", default=["debugmodel", "debug_100m"])
    parser.add_argument("--seq_len", type=int, default=256)
    a = parser.parse_args()
    print(f"2 ranks (FSDP 2), CPU, seq_len {a.seq_len}, batch 4 per rank")
    print(f"{'flavor':<12} {'signal->exit s':>15} {'its save s':>11} {'kill->start s':>14} "
          f"{'kill->1st step s':>17}")  # fmt: skip
    for flavor in a.flavors:
        to_exit, save = preemption(flavor, a.seq_len)
        to_start, to_step = crash(flavor, a.seq_len)
        print(f"{flavor:<12} {to_exit:>15.1f} {save:>11.2f} {to_start:>14.1f} {to_step:>17.1f}")


if __name__ == "__main__":
    main()

"""How integration tests start runs: ``run_train.sh`` as users do, in a clean environment."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A short sequence and a fixed seed: multi-rank runs that finish in seconds.
SMALL = [
    "--training.seq_len", "64", "--debug.seed", "0", "--metrics.log_freq", "1",
    "--metrics.no_report",
]  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without a parent launcher's rank variables, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return env | {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"} | extra


def run_train(
    dump: Path, *flags: str, ngpu: int, log_rank: str = "0", timeout: int = 300, **env: str
) -> subprocess.CompletedProcess:
    """``NGPU=ngpu ./run_train.sh`` with ``SMALL`` and ``flags``, writing under ``dump``."""
    return subprocess.run(
        ["./run_train.sh", *SMALL, "--job.dump_folder", str(dump), *flags],
        cwd=REPO,
        env=clean_env(NGPU=str(ngpu), LOG_RANK=log_rank, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(path: Path) -> list[dict]:
    """The metrics lines of a JSONL file (or of ``<dump>/metrics.jsonl`` for a folder)."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_trainer_and_exit() -> None:
    """A harness's entry: ``torchtitan.train.main`` on this process's arguments, then exit
    with its code without the interpreter's shutdown (see ``torchtitan/train.py``)."""
    from torchtitan import train

    code = train.main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""One training run of ``run_train.sh`` for a benchmark: launched in a folder of its own,
its per-step records read back from ``metrics.jsonl``. No torch import here."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_records(
    flags: list[str], *, ranks: int = 1, env: dict[str, str] | None = None
) -> list[dict]:
    """The metrics records of ``./run_train.sh FLAGS`` on ``ranks`` processes (with ``env``
    added), seeded, without checkpoints; exits with the run's last output if it fails."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = ["./run_train.sh", "--checkpoint.no_enable", "--debug.seed", "0"]
        cmd += ["--job.dump_folder", dump, *flags]
        full_env = os.environ | {"NGPU": str(ranks), "PYTHON": sys.executable} | (env or {})
        out = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
        lines = (Path(dump) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]

"""``scripts/average_checkpoints.py`` on a real run's checkpoints: the weights of its last two
steps averaged, the result starting a run, sampling and validated with ``--validation.only``
(which validates a run's newest step as the run did, leaving its folder as it was); an
existing ``--out`` refused in one line. The arithmetic and the other refusals: ``tests/unit_tests/components/test_checkpoint_average.py``."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO, SMALL, records

from torchtitan import generate
from torchtitan.components.checkpoint_files import read_full_model
from torchtitan.train import main

VALIDATION = [
    "--debug.deterministic", "--validation.enable", "--validation.freq", "2", "--validation.steps",
    "2",
]  # fmt: skip

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:'set_vital'"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def test_an_average_of_a_runs_last_checkpoints_starts_a_run_and_validates(tmp_path: Path) -> None:
    run = tmp_path / "run"
    flags = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2"]
    assert main([*SMALL, *flags, *VALIDATION, "--job.dump_folder", str(run)]) == 0
    out = tmp_path / "averaged"
    command = [
        sys.executable, "scripts/average_checkpoints.py", str(run / "checkpoint"), "--last", "2",
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Averaged 2 checkpoints (step-4, step-6) into ")
    sources = [read_full_model(run / "checkpoint" / f"step-{s}") for s in (4, 6)]
    got = read_full_model(out)
    assert got.keys() == sources[0].keys()
    for name, tensor in got.items():
        mean = (sources[0][name].double() + sources[1][name].double()) / 2
        assert torch.equal(tensor, mean.to(tensor.dtype)), name
    assert not torch.equal(got["tok_embeddings.weight"], sources[1]["tok_embeddings.weight"])

    start = tmp_path / "from_average"
    steps = [
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(out),
    ]
    assert main([*SMALL, *steps, "--job.dump_folder", str(start)]) == 0
    (log,) = (start / "logs").glob("*/rank0.log")
    assert f"Loading model weights from {out}" in log.read_text()
    assert generate.main([str(out), "--max_new_tokens", "3"]) == 0

    # --validation.only: the run's newest step validates as the run did after step 6, and the
    # run's folder is left as it was but for the validation's record (and a log).
    before = _files(run)
    only = [*SMALL, *VALIDATION, "--validation.only", "--checkpoint.enable"]
    assert main([*only, "--job.dump_folder", str(run)]) == 0
    assert _files(run) == before | {"validation_only.jsonl": _files(run)["validation_only.jsonl"]}
    (record,) = records(run / "validation_only.jsonl")
    logged = [r for r in records(run) if "validation_loss" in r][-1]
    assert (record["step"], record["validation_loss"]) == (6, logged["validation_loss"])
    assert record["weights"] == str(run / "checkpoint" / "step-6")
    averaged = tmp_path / "validate_average"
    initial = ["--checkpoint.initial_load_path", str(out)]
    assert main([*only, *initial, "--job.dump_folder", str(averaged)]) == 0
    (record,) = records(averaged / "validation_only.jsonl")
    assert record["step"] == 0 and record["weights"] == str(out)
    assert record["validation_loss"] != logged["validation_loss"]
    assert sorted(p.name for p in averaged.iterdir()) == ["logs", "validation_only.jsonl"]

    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2
    assert (
        again.stderr == f"error: {out} exists: averaging writes a new folder; pick another --out\n"
    )


def _files(folder: Path) -> dict[str, int]:
    """Each file under ``folder`` (its logs left out) with its modification time."""
    return {
        str(p.relative_to(folder)): p.stat().st_mtime_ns
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).parts[0] != "logs"
    }

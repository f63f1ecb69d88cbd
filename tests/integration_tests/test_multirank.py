"""Real multi-process runs on CPU with gloo, launched the way users launch them."""

import subprocess
import sys

import pytest
from launch import REPO, SMALL, clean_env, records, run_train

pytestmark = pytest.mark.integration


def _run_train(tmp_path, *flags: str, ngpu: int = 2, log_rank: str = "0", timeout: int = 300):
    return run_train(tmp_path, *flags, ngpu=ngpu, log_rank=log_rank, timeout=timeout)


def test_run_train_sh_two_fsdp_ranks_train_in_sync(tmp_path):
    result = _run_train(
        tmp_path,
        "--training.steps",
        "6",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.save_for_all_ranks",
        log_rank="0,1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "dp_shard=2" in out and "step:  6" in out
    r0 = records(tmp_path / "metrics_rank0.jsonl")
    r1 = records(tmp_path / "metrics_rank1.jsonl")
    assert [r["step"] for r in r0] == list(range(1, 7))
    for a, b in zip(r0, r1, strict=True):
        # Globally reduced values agree on both ranks; each rank's own loss is its own data's.
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert a["loss_max"] == max(a["loss_local"], b["loss_local"])
        assert a["loss"] == pytest.approx((a["loss_local"] + b["loss_local"]) / 2, rel=1e-6)
    assert r0[0]["loss_local"] != r1[0]["loss_local"]
    assert r0[-1]["loss"] < r0[0]["loss"] - 0.3


def test_replicated_ranks_end_with_identical_weights(tmp_path):
    result = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
            str(REPO / "tests/integration_tests/dp_sync_check.py"),
            *SMALL, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
            "--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "1",
        ],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DP SYNC OK" in result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--training.stepz", "3"],
            "unknown flag --training.stepz (did you mean --training.steps?)",
        ),
        (["--parallelism.data_parallel_replicate_degree", "3"], "world size 2 is not divisible"),
        (["--training.steps", "0"], "--training.steps=0 must be >= 1"),
    ],
)
def test_bad_input_fails_before_launch_with_one_line(tmp_path, flags, message):
    result = _run_train(tmp_path, *flags, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "config.toml").exists()

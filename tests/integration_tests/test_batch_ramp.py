"""A batch ramp (``--training.global_batch_size_start``) trains each step exactly as a run at
that step's batch: resuming its checkpoints with the batch fixed gives the same losses. FSDP 2
(other accumulation batches for the same flags) follows the one-process ramp, and resumes
mid-ramp bitwise (with a dataloader worker). The layouts' numerics (FSDP, PP x FSDP, MoE under
EP) are cases of ``test_parallel_numerics``."""

import shutil
from pathlib import Path

import pytest
from launch import SMALL, records, run_train

from torchtitan.train import main

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:'set_vital'")]

RUN = [
    *SMALL, "--debug.deterministic", "--training.steps", "6", "--training.data_sharding",
    "by_row", "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable",
    "--checkpoint.interval", "2",
]  # fmt: skip
# 4, 4, 8, 12, 12, 12 sequences per step: 4 until 8 are trained on, 8 until 16.
RAMP = [
    "--training.global_batch_size", "12", "--training.global_batch_size_start", "4",
    "--training.global_batch_size_ramp_sequences", "16",
]  # fmt: skip


def _losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(dump) if "loss" in r}


def _resume(source: Path, step: int, dump: Path) -> Path:
    shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    return dump


def test_a_ramp_trains_each_step_at_its_batch(tmp_path: Path) -> None:
    ramp = tmp_path / "ramp"
    one = ["--training.local_batch_size", "2"]  # 2, 2, 4, 6, 6, 6 accumulation batches
    assert main([*RUN, *RAMP, *one, "--job.dump_folder", str(ramp)]) == 0
    want = _losses(ramp)
    assert [r["global_batch_size"] for r in records(ramp) if "loss" in r] == [4, 4, 8, 12, 12, 12]

    # Its step-2 checkpoint resumed at a fixed batch of 8, its step-4 one at 12: the steps at
    # those batches are the ramp's, bitwise.
    for step, batch, same in ((2, "8", (3,)), (4, "12", (5, 6))):
        fixed = _resume(ramp, step, tmp_path / f"fixed_{batch}")
        flags = [*one, "--training.global_batch_size", batch, "--job.dump_folder", str(fixed)]
        assert main([*RUN, *flags]) == 0
        got = _losses(fixed)
        assert [got[s] for s in same] == [want[s] for s in same]
        if step == 2:  # the ramp's step 4 takes 12 sequences, not 8
            assert got[4] != want[4]

    # FSDP 2 (1, 1, 2, 3, 3, 3 accumulation batches of 2 per rank) with a worker, checkpointed
    # at step 2, then resumed there: step 3 is the first of 2 accumulation batches.
    fsdp = tmp_path / "fsdp"
    two = [*RAMP, "--training.local_batch_size", "2", "--training.num_workers", "1"]
    result = run_train(fsdp, *RUN, *two, ngpu=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batch: 8" in result.stdout + result.stderr
    assert list(_losses(fsdp).values()) == pytest.approx(list(want.values()), rel=1e-5)
    resumed = _resume(fsdp, 2, tmp_path / "resumed")
    result = run_train(resumed, *RUN, *two, ngpu=2)
    assert result.returncode == 0, result.stderr[-3000:]
    again = _losses(resumed)
    assert sorted(again) == [3, 4, 5, 6]
    assert [again[s] for s in (3, 4, 5, 6)] == [_losses(fsdp)[s] for s in (3, 4, 5, 6)]


def test_the_lr_schedule_can_count_tokens(tmp_path: Path) -> None:
    """``--lr_scheduler.unit tokens``: each step's LR is the curve at the full batches' worth of
    sequences trained through it (through steps 1-6: 4, 8, 16, 28, 40, 52 of a full 12; warm-up
    over 2 full batches, then a linear decay over the other 7/3), also when resumed mid-ramp."""
    flags = [
        *RUN, *RAMP, "--training.local_batch_size", "2", "--lr_scheduler.unit", "tokens",
        "--optimizer.lr", "0.001", "--lr_scheduler.decay_type", "linear",
        "--lr_scheduler.min_lr_factor", "0",
    ]  # fmt: skip
    dump = tmp_path / "tokens"
    assert main([*flags, "--job.dump_folder", str(dump)]) == 0
    lrs = {r["step"]: r["lr"] for r in records(dump) if "loss" in r}
    want = [1 / 9, 2 / 9, 4 / 9, 7 / 9, 1 - (4 / 3) / (7 / 3), 0.0]
    assert list(lrs.values()) == pytest.approx([0.001 * f for f in want], abs=1e-12)
    (log,) = (dump / "logs").glob("*/rank0.log")
    assert (
        "LR: warm-up to step 4, counted in tokens (2 full batches), linear decay over steps 5-6"
        in (log.read_text())
    )
    resumed = _resume(dump, 2, tmp_path / "resumed")
    assert main([*flags, "--job.dump_folder", str(resumed)]) == 0
    again = {r["step"]: r["lr"] for r in records(resumed) if "loss" in r}
    assert again == {step: lrs[step] for step in (3, 4, 5, 6)}

"""Pipeline-parallel checkpoints: a PP run resumes bitwise, its checkpoint continues in one
process, and a one-process checkpoint continues under PP x FSDP. Numerics of every schedule
against one process are in test_parallel_numerics.py."""

import shutil

import pytest
from launch import records, run_train

PP = [
    "--parallelism.pipeline_parallel_degree", "2",
    "--parallelism.pipeline_parallel_microbatch_size", "2",
]  # fmt: skip
COMMON = [
    "--training.data_sharding", "by_row", "--debug.deterministic",
    "--training.steps", "6", "--lr_scheduler.warmup_steps", "2",
    "--checkpoint.enable", "--checkpoint.interval", "3",
]  # fmt: skip


def _resume(tmp_path, source, name, *flags, ngpu):
    """Continue from ``source``'s step-3 in a new dump folder."""
    dump = tmp_path / name
    shutil.copytree(source / "checkpoint" / "step-3", dump / "checkpoint" / "step-3")
    result = run_train(dump, *COMMON, *flags, ngpu=ngpu)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Loading checkpoint" in result.stdout + result.stderr
    return [r["loss"] for r in records(dump)]


def _run(dump, *flags, ngpu):
    result = run_train(dump, *COMMON, *flags, ngpu=ngpu)
    assert result.returncode == 0, result.stderr[-3000:]
    # The whole model's size, whichever stages the rank holds (rank 0: 2 of Interleaved1F1B's 4).
    expected = "Model llama3 debugmodel: 5,770,496 parameters"
    expected += " (3,672,064 in this rank's pipeline stages)" if "pp" in dump.name else ""
    assert expected in result.stdout + result.stderr, result.stderr[-3000:]
    return [r["loss"] for r in records(dump)]


def test_pipeline_checkpoints_resume_and_move_between_layouts(tmp_path):
    interleaved = [*PP, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    pp = _run(tmp_path / "pp", *interleaved, ngpu=2)
    one = _run(tmp_path / "one", ngpu=1)
    # Rank 0 logs its measured bubble next to the schedule's ideal (4 stages, 4 micro-batches).
    for record in records(tmp_path / "pp"):
        assert record["pp_bubble_ideal_pct"] == pytest.approx(100 / 9)
        assert 0 <= record["pp_idle_pct"] < 100
    assert len(pp) == 6 and pp == pytest.approx(one, rel=1e-5)

    # PP 2 resumes bitwise; its step-3 continues in one process.
    assert _resume(tmp_path, tmp_path / "pp", "pp_resumed", *interleaved, ngpu=2) == pp[3:]
    assert _resume(tmp_path, tmp_path / "pp", "pp_to_one", ngpu=1) == pytest.approx(
        pp[3:], rel=1e-5
    )
    # A one-process step-3 continues under PP 2 x FSDP 2 (1F1B).
    four_ranks = [*PP, "--training.local_batch_size", "4"]
    resumed = _resume(tmp_path, tmp_path / "one", "one_to_pp_fsdp", *four_ranks, ngpu=4)
    assert resumed == pytest.approx(one[3:], rel=1e-5)

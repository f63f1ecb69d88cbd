"""Faults and second runs on real launches: extending a finished run (the example of
docs/checkpoint.md), the LR rule on resume, and damaged checkpoints refused in one line."""

import pytest
from launch import records, run_train

pytestmark = pytest.mark.integration

FAST = ["--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "2"]


def test_a_finished_run_extends_with_more_steps_and_the_lr_rule_is_said(tmp_path):
    first = run_train(tmp_path, *FAST, "--training.steps", "4", ngpu=2)
    assert first.returncode == 0, first.stderr[-3000:]
    # The final save is a full checkpoint by default: the same command with more steps
    # resumes it (docs/checkpoint.md's first example).
    second = run_train(tmp_path, *FAST, "--training.steps", "8", ngpu=2)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "Loading checkpoint" in out and "step-4" in out
    # The schedule follows this run's --training.steps, and one line says what changed.
    warning = next(line for line in out.splitlines() if "LR schedule:" in line)
    assert "--training.steps 4" in warning and "--training.steps 8" in warning
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7, 8]
    announced = float(warning.split("step 5 trains at lr ")[1].split()[0])
    assert steps[4]["lr"] == pytest.approx(announced, rel=1e-3)


def test_a_folder_of_damaged_checkpoints_is_refused_in_one_line(tmp_path):
    first = run_train(tmp_path, *FAST, "--training.steps", "2", ngpu=2)
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "checkpoint" / "step-2" / "manifest.json").unlink()
    again = run_train(tmp_path, *FAST, "--training.steps", "4", ngpu=2)
    out = again.stdout + again.stderr
    assert again.returncode == 2, out[-3000:]
    assert "Traceback" not in out
    assert "error: every checkpoint in" in out.splitlines()[-1]
    assert (tmp_path / "checkpoint" / "step-2").is_dir()  # untouched

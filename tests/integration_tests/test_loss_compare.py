"""scripts/loss_compare.py: a real FSDP-vs-one-process comparison through run_train.sh, and its
verdicts (exit status, table, checks) on small handwritten metrics files."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "loss_compare.py"

pytestmark = pytest.mark.integration


def _load_script():
    spec = importlib.util.spec_from_file_location("loss_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["loss_compare"] = module
    spec.loader.exec_module(module)
    return module


loss_compare = _load_script()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return env | {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}


def test_fsdp_two_ranks_match_one_process_with_accumulation_bitwise(tmp_path):
    # 4 sequences per step either way: 2 ranks x 2, or 1 process x 2 accumulation batches of 2.
    result = subprocess.run(
        [
            sys.executable, str(SCRIPT),
            "--baseline", "NGPU=1 --training.global_batch_size 4",
            "--test", "NGPU=2",
            "--common", "--training.steps 5 --training.local_batch_size 2 --training.seq_len 64",
            "--metrics", "loss,grad_norm", "--assert-equal", "--rtol", "1e-3",
            "--output-folder", str(tmp_path),
        ],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "baseline loss" in out and "test grad_norm" in out
    table = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["5"])]
    assert len(table) == 4  # steps 1 and 5 of the loss and of the grad-norm table
    assert "loss       bitwise equal at 5/5 steps" in out
    assert "PASS  --assert-equal: loss bitwise equal at every step" in out
    assert (tmp_path / "loss_compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    seed = tmp_path / "seed" / "checkpoint" / "step-0"
    for run in ("baseline", "test"):
        assert f"Loading model weights from {seed}" in (tmp_path / run / "train.log").read_text()
        steps = [json.loads(line)["step"] for line in (tmp_path / run / "metrics.jsonl").open()]
        assert steps == [1, 2, 3, 4, 5]


def test_pipeline_two_ranks_match_one_process_with_accumulation_bitwise(tmp_path):
    # 4 pipeline micro-batches of 2 sequences vs 1 process accumulating 4 batches of 2: the same
    # kernels on the same rows, gradients added in the same order, loaded from a seed checkpoint.
    pp = (
        "--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_microbatch_size 2"
    )
    result = subprocess.run(
        [
            sys.executable, str(SCRIPT),
            "--baseline", "NGPU=1 --training.local_batch_size 2 --training.global_batch_size 8",
            "--test", f"NGPU=2 --training.local_batch_size 8 {pp}",
            "--common", "--training.steps 5 --training.seq_len 64",
            "--metrics", "loss,grad_norm", "--assert-equal", "--output-folder", str(tmp_path),
        ],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "loss       bitwise equal at 5/5 steps" in out
    assert "grad_norm  bitwise equal at 5/5 steps" in out


# ---- comparing existing runs: no training ---------------------------------------------------

BASELINE = [8.125, 7.5, 7.0]
ONE_ULP = math.nextafter(7.5, math.inf)


def _metrics(folder: Path, losses: list[float], grad_norms: list[float] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    grad_norms = grad_norms or [1.0] * len(losses)
    records = [
        {"step": step, "loss": loss, "grad_norm": norm, "lr": 1e-3}
        for step, (loss, norm) in enumerate(zip(losses, grad_norms, strict=True), 1)
    ]
    path = folder / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _compare(tmp_path, test_losses, *flags, capsys, test_grad_norms=None):
    baseline = _metrics(tmp_path / "baseline", BASELINE)
    test = _metrics(tmp_path / "test", test_losses, test_grad_norms)
    code = loss_compare.main(
        [
            "--baseline-metrics", str(baseline.parent),  # a dump folder
            "--test-metrics", str(test),  # a metrics.jsonl file
            "--output-folder", str(tmp_path / "out"), "--no-plot", *flags,
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    ("test_losses", "flags", "code", "message"),
    [
        (BASELINE, ["--assert-equal"], 0, "PASS  --assert-equal"),
        ([8.125, ONE_ULP, 7.0], ["--assert-equal"], 1, "FAIL  --assert-equal"),
        ([8.125, ONE_ULP, 7.0], ["--rtol", "1e-12"], 0, "PASS  --rtol 1e-12: loss"),
        ([8.125, 7.5075, 7.0], ["--rtol", "1e-4"], 1, "exceeded at steps 2"),
        ([8.125, 7.5075, 7.0], ["--rtol", "2e-3"], 0, "PASS  --rtol 0.002: loss"),
        ([8.125, 7.5075, 7.0], ["--atol", "1e-2"], 0, "PASS  --atol 0.01: loss"),
        ([8.125, 7.5075, 7.0], ["--atol", "1e-3"], 1, "FAIL  --atol 0.001: loss"),
        ([8.125, math.nan, 7.0], ["--rtol", "1"], 1, "exceeded at steps 2"),
        # Without any check, differences are only reported.
        ([8.125, 7.5075, 7.0], [], 0, "max rel diff 1.000e-03 (step 2)"),
    ],
)
def test_verdicts_on_handwritten_metrics(tmp_path, capsys, test_losses, flags, code, message):
    got, out = _compare(tmp_path, test_losses, *flags, capsys=capsys)
    assert got == code, out
    assert message in out


def test_table_shows_each_step_with_its_differences(tmp_path, capsys):
    code, out = _compare(tmp_path, [8.125, 7.5075, 7.0], capsys=capsys)
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line[:6].strip()}
    assert rows["1"] == ["8.125", "8.125", "0", "0"]
    assert rows["2"] == ["7.5", "7.5075", "7.500e-03", "1.000e-03"]
    assert "loss       bitwise equal at 2/3 steps" in out


def test_assert_equal_is_about_the_loss_and_tolerances_about_every_metric(tmp_path, capsys):
    norms = [1.0, 1.0001, 1.0]
    code, out = _compare(
        tmp_path, BASELINE, "--metrics", "loss,grad_norm", "--assert-equal",
        capsys=capsys, test_grad_norms=norms,
    )  # fmt: skip
    assert code == 0, out
    assert "grad_norm  bitwise equal at 2/3 steps" in out
    code, out = _compare(
        tmp_path, BASELINE, "--metrics", "loss,grad_norm", "--rtol", "1e-5",
        capsys=capsys, test_grad_norms=norms,
    )  # fmt: skip
    assert code == 1
    assert "PASS  --rtol 1e-05: loss" in out and "FAIL  --rtol 1e-05: grad_norm" in out


def test_different_step_lists_fail_even_without_checks(tmp_path, capsys):
    code, out = _compare(tmp_path, BASELINE[:2], capsys=capsys)
    assert code == 1
    assert "FAIL  the runs logged different steps: baseline only [3], test only []" in out


def test_unknown_metric_is_bad_input(tmp_path, capsys):
    code, out = _compare(tmp_path, BASELINE, "--metrics", "loss,gradnorm", capsys=capsys)
    assert code == 2
    assert "--metrics gradnorm: the baseline run has no 'gradnorm' at step 1" in out


def test_plot_is_written_and_skipped_with_a_hint_without_matplotlib(tmp_path, capsys, monkeypatch):
    baseline = _metrics(tmp_path / "a", BASELINE)
    test = _metrics(tmp_path / "b", [8.125, 7.5075, 7.0])
    argv = ["--baseline-metrics", str(baseline), "--test-metrics", str(test)]
    assert loss_compare.main([*argv, "--output-folder", str(tmp_path / "with")]) == 0
    assert (tmp_path / "with" / "loss_compare.png").is_file()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert loss_compare.main([*argv, "--output-folder", str(tmp_path / "without")]) == 0
    assert "pip install -e '.[plot]'" in capsys.readouterr().out
    assert not (tmp_path / "without" / "loss_compare.png").exists()


def test_failed_run_exits_3_with_the_tail_of_its_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHON", sys.executable)
    code = loss_compare.main(
        [
            "--baseline", "NGPU=1 --training.stepz 3", "--test", "NGPU=1",
            "--no-seed-checkpoint", "--output-folder", str(tmp_path),
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 3
    assert "baseline run failed (exit 2)" in err
    assert "unknown flag --training.stepz (did you mean --training.steps?)" in err
    assert not (tmp_path / "test").exists()

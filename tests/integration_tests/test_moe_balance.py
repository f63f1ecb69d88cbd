"""The mixture-of-experts debug model learns on the bundled corpus, and bias balancing
evens out the experts' loads. (Numerics against one process under EP, FSDP and TP:
``test_parallel_numerics.py``; resume under EP: ``test_checkpoint.py``.)"""

import sys

import pytest
from launch import REPO, records, run_train

pytestmark = pytest.mark.integration

MOE = [
    "--training.steps", "30", "--training.seq_len", "128", "--checkpoint.no_enable",
    "--metrics.log_freq", "5",
]  # fmt: skip


def _run(dump, coeff: str) -> list[dict]:
    result = run_train(
        dump, *MOE, "--moe.load_balance_coeff", coeff, ngpu=1,
        MODULE="deepseek_v3", CONFIG="deepseek_v3_debugmodel",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return records(dump)


def test_the_debug_model_learns_and_bias_balancing_lowers_the_expert_load(tmp_path):
    without = _run(tmp_path / "without", "0")
    balanced = _run(tmp_path / "balanced", "0.01")
    for run in (without, balanced):
        assert run[-1]["loss"] < run[0]["loss"] - 1.5  # 8.1 -> about 6.1 in 30 steps
        assert all(r["moe_load_max_over_mean"] >= 1 for r in run)
    # Measured: 3.42 without, 2.62 with at step 30 (unbalanced routing collapses onto few
    # experts early); the same steps, the same data and initial weights.
    assert [r["step"] for r in without] == [r["step"] for r in balanced]
    assert balanced[-1]["moe_load_max_over_mean"] < 0.9 * without[-1]["moe_load_max_over_mean"]
    assert "moe_bias_update" in balanced[-1] and "moe_bias_update" not in without[-1]
    assert all(k in balanced[-1] for k in ("moe_load_max_over_mean/layers.1.moe",))
    # The plot of both runs: one panel each, one line per MoE layer, the last points the
    # logged values.
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(REPO / "scripts"))
    import plot_moe_load

    png = tmp_path / "load.png"
    fig = plot_moe_load.plot(png, [tmp_path / "without", tmp_path / "balanced"], ["off", "on"])
    assert png.stat().st_size > 10_000
    for ax, run in zip(fig.axes, (without, balanced), strict=True):
        lines = {
            line.get_label(): line
            for line in ax.get_lines()
            if not line.get_label().startswith("_")
        }
        assert sorted(lines) == ["layers.1.moe", "layers.2.moe", "layers.3.moe"]
        for layer, line in lines.items():
            assert list(line.get_xdata()) == [r["step"] for r in run]
            assert line.get_ydata()[-1] == run[-1][f"moe_load_max_over_mean/{layer}"]


def test_qwen3_moe_logs_its_expert_loads_on_every_line_validation_steps_included(tmp_path):
    """Qwen3's MoE balances by the loss alone (its configs: no routing bias); a step that
    logs only because validation ran carries the MoE metrics too."""
    result = run_train(
        tmp_path, "--training.steps", "6", "--training.seq_len", "128", "--checkpoint.no_enable",
        "--metrics.log_freq", "4", "--validation.enable", "--validation.freq", "3",
        "--validation.steps", "2", ngpu=1, MODULE="qwen3", CONFIG="qwen3_moe_debugmodel",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run = [r for r in records(tmp_path) if "loss" in r]
    assert [r["step"] for r in run] == [1, 3, 4, 6]  # the first step always logs
    for r in run:
        assert r["moe_load_max_over_mean"] >= 1 and r["moe_aux_loss"] > 0, r
        assert "moe_bias_update" not in r  # --moe.load_balance_coeff 0


def test_a_skipped_step_moves_no_routing_bias(tmp_path):
    """--debug.skip_nonfinite_steps: a step whose gradient norm is not finite updates nothing,
    the routing bias included, and its log line reports no balancing."""
    result = run_train(
        tmp_path, "--training.steps", "4", "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps",
        "0", "--checkpoint.no_enable", "--debug.skip_nonfinite_steps",
        "--moe.load_balance_coeff", "0.01", ngpu=1, MODULE="deepseek_v3",
        CONFIG="deepseek_v3_debugmodel",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run = [r for r in records(tmp_path) if "loss" in r]
    before = [{"skipped_steps": 0}, *run[:-1]]
    skipped = [b["skipped_steps"] > a["skipped_steps"] for a, b in zip(before, run, strict=True)]
    assert any(skipped) and not skipped[0]
    for r, was_skipped in zip(run, skipped, strict=True):
        assert ("moe_bias_update" in r) != was_skipped, r


def test_forced_balance_gives_every_expert_the_same_routings_under_expert_parallelism(tmp_path):
    """--moe.force_load_balance (for benchmarks): under EP 2 every expert of every layer gets
    the same routings at every step, though the router would pick otherwise; the routing bias
    learns nothing from forced routings."""
    result = run_train(
        tmp_path, "--training.steps", "3", "--training.seq_len", "64", "--checkpoint.no_enable",
        "--metrics.log_freq", "1", "--moe.load_balance_coeff", "0.01",
        "--moe.force_load_balance", "--parallelism.expert_parallel_degree", "2", ngpu=2,
        MODULE="deepseek_v3", CONFIG="deepseek_v3_debugmodel",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run = [r for r in records(tmp_path) if "loss" in r]
    assert [r["step"] for r in run] == [1, 2, 3]
    for r in run:
        loads = {k: v for k, v in r.items() if k.startswith("moe_load_max_over_mean")}
        assert len(loads) > 1 and set(loads.values()) == {1.0}, r
        assert "moe_bias_update" not in r, r

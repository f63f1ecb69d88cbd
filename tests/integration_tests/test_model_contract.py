"""A model family defined in the test folder, through ``ModelSpec`` alone (no core change),
is validated before launch and trains with FSDP over 2 ranks."""

import math

import pytest
from launch import REPO, records, run_train
from toy_family import ToyArgs

TOY = {
    "MODULE": "toy_family",
    "CONFIG": "toy_debugmodel",
    "PYTHONPATH": str(REPO / "tests/integration_tests"),
}


def test_out_of_tree_family_trains_with_fsdp_2(tmp_path):
    result = run_train(tmp_path, ngpu=2, **TOY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dp_shard=2" in result.stdout + result.stderr
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2]
    losses = [r["loss"] for r in steps]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] > 7.0  # about ln(2048) = 7.6 from a random init
    assert losses[1] < losses[0]
    # Each of the 2 ranks holds half of the parameters: FSDP sharded the family's model.
    full_mib = ToyArgs().num_params() * 4 / 2**20
    assert steps[0]["param_mib"] == pytest.approx(full_mib / 2, rel=0.02)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("--parallelism.tensor_parallel_degree 2", "the toy family has no tensor-parallel plan"),
        (
            "--parallelism.context_parallel_degree 2",
            "model toy_family does not support context parallelism",
        ),
        ("--model.attn_mask block_causal", "model toy_family does not take document_ids"),
    ],
)
def test_family_rules_run_before_any_rank_starts(tmp_path, flags, expected):
    result = run_train(tmp_path, *flags.split(), ngpu=2, **TOY)
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()  # no rank ever started

"""``--training.spike_sigma``'s verdicts on each step's loss and gradient norm."""

import json

import pytest

from torchtitan.components.spikes import SpikeGuard


def _verdicts(guard: SpikeGuard, values: list[tuple[float, float]], first: int = 1) -> list[int]:
    """The steps whose updates the guard skips."""
    return [s for s, v in enumerate(values, first) if guard.judge_values(s, *v) is not None]


def test_no_step_is_judged_before_the_window_is_full() -> None:
    guard = SpikeGuard(sigma=3, window=4)
    # Steps 2-4 would be huge spikes by any window; the first judged step is 5.
    values = [(1.0, 1.0), (50.0, 1.0), (1.0, 60.0), (1.5, 1.0), (1.0, 1.0)]
    assert _verdicts(guard, values) == []


def test_a_value_above_mean_plus_sigma_std_spikes() -> None:
    window = [(2.0, 1.0), (2.2, 1.2), (1.8, 0.8), (2.0, 1.0)]  # mean 2 and 1, std 0.141 and 0.141
    for loss, grad_norm, spikes in (
        (2.0 + 3 * 0.1414, 1.0, False),  # 3.0 standard deviations: not above 3
        (2.0 + 3.1 * 0.1414, 1.0, True),
        (1.0, 1.0, False),  # a drop is never a spike
        (2.0, 1.5, True),  # the gradient norm alone
    ):
        guard = SpikeGuard(sigma=3, window=4)
        _verdicts(guard, window)
        verdict = guard.judge_values(5, loss, grad_norm)
        assert (verdict is not None) == spikes, (loss, grad_norm)
    assert verdict == (
        "Step 5: gradient norm 1.5 is 3.5 standard deviations above the last 4 steps' mean 1: "
        "update skipped as a spike (--training.spike_sigma 3; 1 so far)"
    )


def test_a_lasting_change_of_level_stops_spiking_after_a_few_steps() -> None:
    """A spike's values join the window: a new level (a new data mix) is skipped for a few steps
    only, not for ever."""
    guard = SpikeGuard(sigma=6, window=16)
    base = [(3.0 + 0.01 * (i % 3), 1.0 + 0.01 * (i % 2)) for i in range(16)]
    assert _verdicts(guard, base) == []
    skipped = _verdicts(guard, [(3.5, 1.0)] * 16, first=17)
    assert skipped and skipped == list(range(17, 17 + len(skipped))) and len(skipped) <= 3


def test_a_window_without_spread_judges_nothing() -> None:
    guard = SpikeGuard(sigma=6, window=3)
    assert _verdicts(guard, [(2.0, 1.0)] * 3 + [(9.0, 9.0)]) == []


@pytest.mark.parametrize("window", [2, 3, 8])
def test_the_window_round_trips_through_its_state(window: int) -> None:
    """Saved as one string: a run with another window keeps the newest values that fit."""
    guard = SpikeGuard(sigma=1, window=3)
    values = [(1.0, 1.0), (1.1, 1.05), (0.9, 0.95), (1.3, 1.0), (1.0, 1.0)]
    _verdicts(guard, values)
    state = guard.state_dict()
    assert set(state) == {"window"} and isinstance(state["window"], str)
    assert json.loads(state["window"])["loss"] == [0.9, 1.3, 1.0]
    other = SpikeGuard(sigma=1, window=window)
    other.load_state_dict(state)
    assert other.skipped == guard.skipped == 1
    assert list(other.history["loss"]) == [0.9, 1.3, 1.0][-window:]
    if window == 3:  # the same verdicts from here on
        more = [(1.6, 1.0), (1.0, 1.0), (1.0, 1.4)]
        assert _verdicts(other, more) == _verdicts(guard, more) != []


def test_the_ranks_agree_on_the_verdict() -> None:
    """Every rank takes the branch any rank's verdict asks for (``agree``: the job's answer)."""
    guard = SpikeGuard(sigma=3, window=2)
    _verdicts(guard, [(1.0, 1.0), (1.2, 1.1)])
    line = guard.judge_values(3, 1.1, 1.05, agree=lambda mine: True)
    assert line == (
        "Step 3: another rank's values spiked (equal to this rank's but for rounding): update "
        "skipped as a spike (--training.spike_sigma 3; 1 so far)"
    )
    assert guard.judge_values(4, 9.0, 9.0, agree=lambda mine: False) is None
    assert guard.skipped == 1 and list(guard.history["loss"]) == [1.1, 9.0]


def test_a_dropped_update_leaves_no_routing_counts() -> None:
    """Like a step whose data was skipped: the next bias update counts only trained steps."""
    import torch

    from torchtitan.components.nonfinite import drop_update
    from torchtitan.models.common.moe import moe_layers
    from torchtitan.models.spec import get_model_spec

    spec = get_model_spec("qwen3")
    model = spec.build_model(spec.flavors["debugmodel_moe"])
    layers = moe_layers([model])
    assert layers
    for _, layer in layers:
        layer.tokens_per_expert += 3.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    drop_update(optimizer, [model])  # (anything with zero_grad: Optimizers in a run)
    assert all(not layer.tokens_per_expert.any() for _, layer in layers)
    assert all(p.grad is None for p in model.parameters())

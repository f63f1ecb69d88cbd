"""scripts/plot_pipeline_schedules.py: its simulated bubble is the textbook one where that is
known, and torch's own action lists (multi-stage schedules) simulate without deadlock."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plot_pipeline_schedules.py"
spec = importlib.util.spec_from_file_location("plot_pipeline_schedules", SCRIPT)
plot = importlib.util.module_from_spec(spec)
sys.modules["plot_pipeline_schedules"] = plot
spec.loader.exec_module(plot)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16)])
def test_single_stage_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, pp, m):
    timeline = plot.simulate(plot.action_lists(schedule, pp, m), pp)
    assert plot.bubble(timeline) == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_torch_action_lists_run_every_action_once_and_beat_1f1b(schedule):
    lists = plot.action_lists(schedule, 2, 8)
    timeline = plot.simulate(lists, 4)
    ran = [a for row in timeline for *_, a in row]
    assert sorted(ran) == sorted(a for order in lists for a in order)
    assert {kind for _, kind, _ in ran} >= {"F"} and len({mb for *_, mb in ran}) == 8
    assert plot.bubble(timeline) < (2 - 1) / (8 + 2 - 1)

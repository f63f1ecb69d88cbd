"""The pipeline timeline model: its bubble is the textbook one where that is known, and torch's
own action lists (multi-stage schedules) and a CSV schedule simulate without deadlock."""

import pytest

from torchtitan.distributed import pipeline_timeline as plot


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16)])
def test_single_stage_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, pp, m):
    timeline = plot.simulate(plot.action_lists(schedule, pp, m, 1), pp)
    assert plot.bubble(timeline) == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_torch_action_lists_run_every_action_once_and_beat_1f1b(schedule):
    lists = plot.action_lists(schedule, 2, 8, 2)
    timeline = plot.simulate(lists, 4)
    ran = [a for row in timeline for *_, a in row]
    assert sorted(ran) == sorted(a for order in lists for a in order)
    assert {kind for _, kind, _ in ran} >= {"F"} and len({mb for *_, mb in ran}) == 8
    assert plot.bubble(timeline) < (2 - 1) / (8 + 2 - 1)


def test_a_csv_schedule_has_the_bubble_of_its_actions():
    lists = plot.csv_action_lists("tests/assets/pipeline/looped_2ranks_4stages.csv")
    assert [len(order) for order in lists] == [16, 16]
    # Breadth first over 4 stages looped on 2 ranks, like LoopedBFS: 1/9 of the timeline idle.
    assert plot.ideal_bubble(lists) == pytest.approx(1 / 9)


@pytest.mark.parametrize(("pp", "m"), [(2, 8), (4, 8), (8, 4)])
def test_in_flight_micro_batches_are_those_of_the_textbook(pp, m):
    """GPipe keeps every micro-batch until the backwards start; 1F1B keeps p - r on rank r."""
    for r in range(pp):
        weight = {r: 10}
        gpipe = plot.action_lists("GPipe", pp, m, 1)[r]
        one_f_one_b = plot.action_lists("1F1B", pp, m, 1)[r]
        assert plot.peak_in_flight(gpipe, weight) == 10 * m
        assert plot.peak_in_flight(one_f_one_b, weight) == 10 * min(m, pp - r)


def test_a_split_backward_releases_activations_at_its_weight_half():
    actions = [(0, "F", 0), (0, "F", 1), (0, "I", 0), (0, "F", 2), (0, "W", 0), (0, "B", 1)]
    assert plot.peak_in_flight(actions, {0: 1}) == 3
    assert plot.peak_in_flight(actions[:3] + actions[4:5] + actions[3:4], {0: 1}) == 2

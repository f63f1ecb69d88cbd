"""The batch schedule: a ramp's size per step (Megatron-LM's rule, the same in every layout),
accumulation batches and their running total (the ETA's work), the start-up line, and the
steps whose data is skipped."""

from fractions import Fraction

import pytest

from torchtitan.components.batch_schedule import BatchSchedule, sequences_through, step_reaching
from torchtitan.config.errors import ConfigError
from torchtitan.config.execution import Parallelism
from torchtitan.config.job_config import Training
from torchtitan.distributed.parallel_dims import ParallelDims


def _schedule(world: int = 1, **training) -> BatchSchedule:
    dims = ParallelDims.from_config(Parallelism(), world)
    return BatchSchedule.from_config(Training(**training), dims)


def _megatron_sizes(start: int, increment: int, full: int, sequences: int, steps: int) -> list:
    """The batch of each step by Megatron-LM's rampup rule, step by step: start plus one
    increment per share of ``sequences`` trained on, at most full."""
    n, trained, sizes = (full - start) // increment, 0, []
    for _ in range(steps):  # in exact fractions (Megatron's float division can round down)
        batch = min(full, start + increment * int(trained / Fraction(sequences, n)))
        sizes.append(batch)
        trained += batch
    return sizes


def test_the_batch_grows_by_one_increment_per_share_of_the_ramp() -> None:
    """4 -> 12 by 4 over 16 sequences: 4 until 8 are trained on, then 8 until 16, then 12."""
    ramp = _schedule(
        local_batch_size=2, global_batch_size=12, global_batch_size_start=4,
        global_batch_size_increment=4, global_batch_size_ramp_sequences=16,
    )  # fmt: skip
    assert [ramp.global_batch(s) for s in range(1, 7)] == [4, 4, 8, 12, 12, 12]
    assert [ramp.accumulation(s) for s in range(1, 7)] == [2, 2, 4, 6, 6, 6]
    assert ramp.ramps and ramp.last == 6
    assert ramp.describe(64) == (
        "global batch ramping up, x 64 tokens: 4 from step 1, 8 from step 3, 12 from step 4 "
        "(up to 6 accumulation batch(es) of 2 per rank)"
    )


@pytest.mark.parametrize(
    ("start", "increment", "full", "sequences"),
    [(16, 8, 64, 100), (8, 8, 24, 32), (3072, 3072, 15360, 114_501_953), (4, 2, 20, 7),
     (2, 2, 10, 1000), (4, 4, 8, 1), (8, 20, 148, 36)],
)  # fmt: skip
def test_the_sizes_are_megatron_rampup_rule(start, increment, full, sequences) -> None:
    """Each step's batch is the rampup rule of Megatron-LM applied step by step, sizes passed
    over included (16 -> 64 by 8 over 100: one step of 24 trains past two shares)."""
    ramp = _schedule(
        local_batch_size=2, global_batch_size=full, global_batch_size_start=start,
        global_batch_size_increment=increment, global_batch_size_ramp_sequences=sequences,
    )  # fmt: skip
    steps = ramp.stages[-1][0] + 3
    assert [ramp.global_batch(s) for s in range(1, steps + 1)] == _megatron_sizes(
        start, increment, full, sequences, steps
    )
    if sequences == 100:
        assert [b for _, b in ramp.stages] == [16, 24, 40, 56, 64]


def test_the_same_flags_give_the_same_sizes_in_every_layout() -> None:
    flags = dict(
        global_batch_size=48, global_batch_size_start=8, global_batch_size_ramp_sequences=90
    )
    layouts = [(1, 8), (1, 4), (2, 4), (4, 2), (8, 1)]  # (data-parallel ranks, local batch)
    sizes = {
        (world, local): [
            _schedule(world, local_batch_size=local, **flags).global_batch(s) for s in range(1, 12)
        ]
        for world, local in layouts
    }
    assert len({tuple(v) for v in sizes.values()}) == 1, sizes
    assert sizes[(1, 8)][0] == 8 and sizes[(1, 8)][-1] == 48  # the increment: gcd(8, 48) = 8


def test_without_a_ramp_every_step_is_the_global_batch() -> None:
    fixed = _schedule(world=2, local_batch_size=2, global_batch_size=12)
    assert {fixed.accumulation(s) for s in range(1, 50)} == {3}
    assert not fixed.ramps and fixed.batches_through(5) == 15
    assert (
        fixed.describe(64) == "global batch 12 x 64 tokens (3 accumulation batch(es) of 2 per rank)"
    )
    same = _schedule(
        global_batch_size=8, global_batch_size_start=8, global_batch_size_ramp_sequences=50
    )  # a start equal to the full batch is no ramp
    assert not same.ramps and same.batches_through(3) == 3


@pytest.mark.parametrize("sequences", [1, 7, 40, 1000])
def test_batches_through_is_the_running_total(sequences: int) -> None:
    schedule = _schedule(
        local_batch_size=1, global_batch_size=40, global_batch_size_start=5,
        global_batch_size_ramp_sequences=sequences,
    )  # fmt: skip
    per_step = [schedule.accumulation(s) for s in range(1, schedule.stages[-1][0] + 5)]
    assert per_step == sorted(per_step) and per_step[-1] == 40
    assert schedule.batches_through(0) == 0
    for step in range(1, len(per_step) + 1):
        assert schedule.batches_through(step) == sum(per_step[:step]), step


@pytest.mark.parametrize("sequences", [1, 7, 40, 1000])
def test_step_reaching_is_the_first_step_through_which_that_many_are_trained(sequences) -> None:
    stages = _schedule(
        local_batch_size=1, global_batch_size=40, global_batch_size_start=5,
        global_batch_size_ramp_sequences=sequences,
    ).stages  # fmt: skip
    through = [sequences_through(stages, step) for step in range(stages[-1][0] + 5)]
    for wanted in range(through[-1] + 1):
        first = next(step for step, total in enumerate(through) if total >= wanted)
        assert step_reaching(stages, wanted) == first, wanted
    assert step_reaching(stages, 10.5) == step_reaching(stages, 11)  # fractions round up


def test_refusals_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="global_batch_size_start=6 must be a multiple of"):
        _schedule(local_batch_size=4, global_batch_size=16, global_batch_size_start=6,
                  global_batch_size_increment=2, global_batch_size_ramp_sequences=3)  # fmt: skip
    with pytest.raises(ConfigError, match="increment=4 must be a multiple of .* = 8, so that"):
        _schedule(world=2, local_batch_size=4, global_batch_size=24, global_batch_size_start=8,
                  global_batch_size_increment=4, global_batch_size_ramp_sequences=3)  # fmt: skip
    with pytest.raises(
        ConfigError, match="ramp_sequences=3 needs --training.global_batch_size_start"
    ):
        _schedule(global_batch_size_ramp_sequences=3)


def test_the_eta_weighs_the_steps_left_by_their_batches(monkeypatch, tmp_path) -> None:
    """Two steps of one batch took 2 s; the four left run 2 + 2 + 3 + 3 batches: 10 s, where
    counting steps would say 4 s."""
    import torch

    from torchtitan.components import metrics
    from torchtitan.config.job_config import Metrics

    ramp = BatchSchedule(local_batch_size=2, dp_degree=1, stages=((1, 2), (3, 4), (5, 6)))
    clock = iter([100.0, 100.0, 102.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    processor = metrics.MetricsProcessor(
        Metrics(), dump_folder=str(tmp_path), device=torch.device("cpu"), flops_per_token=1,
        rank=0, save_rank=False,
    )  # fmt: skip
    processor.start_run(first_step=0, last_step=6, work=ramp.batches_through)
    assert processor._eta_seconds(2) == pytest.approx(10.0)


def test_skip_steps_parse_to_ranges() -> None:
    from torchtitan.components.batch_schedule import step_ranges

    assert step_ranges(["1450", "1201-1300", " 7 - 9 "]) == ((7, 9), (1201, 1300), (1450, 1450))
    # Overlapping and adjacent ranges are one range (one console line, one event).
    assert step_ranges(["5-10", "8-12", "13", "20-21", "15"]) == ((5, 13), (15, 15), (20, 21))
    schedule = _schedule(skip_steps=["3-4", "9"])
    assert [s for s in range(1, 11) if schedule.skipped(s)] == [3, 4, 9]
    assert schedule.skipped(4) == (3, 4) and schedule.skipped(5) is None
    # The ETA's work leaves the skipped steps out: one accumulation batch per step, 3 skipped.
    assert [schedule.trained_through(s) for s in (2, 4, 9, 10)] == [2, 2, 6, 7]
    for bad, why in (("3-", "is not a step N"), ("a", "is not a step N"), ("5-3", "first <= last"),
                     ("0", "from 1 on"), ("-2", "is not a step N")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            step_ranges([bad])


def test_a_resume_that_changes_the_next_batch_says_so() -> None:
    from torchtitan.components.batch_schedule import resumed_batch_note

    ramp = Training(
        global_batch_size=12, global_batch_size_start=4, global_batch_size_ramp_sequences=16
    )  # 4, 4, 8, 12, ...
    fixed = Training(global_batch_size=12)
    assert resumed_batch_note(fixed, ramp, 2) == (
        "Global batch: the checkpoint's run would train step 3 on 8 sequences; this run trains "
        "it on 12, as its --training.global_batch_size* flags say"
    )
    assert resumed_batch_note(fixed, ramp, 3) is None  # step 4 is at 12 either way
    assert resumed_batch_note(Training(), ramp, 2) is None  # -1: depends on the layout

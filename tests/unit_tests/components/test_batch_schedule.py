"""The batch ramp's schedule: accumulation batches per step, their running total (the ETA's
work), and the start-up line."""

import itertools

import pytest

from torchtitan.components.batch_schedule import BatchSchedule
from torchtitan.config.errors import ConfigError
from torchtitan.config.execution import Parallelism
from torchtitan.config.job_config import Training
from torchtitan.distributed.parallel_dims import ParallelDims


def _schedule(world: int = 1, **training) -> BatchSchedule:
    dims = ParallelDims.from_config(Parallelism(), world)
    return BatchSchedule.from_config(Training(**training), dims)


def test_the_batch_grows_linearly_in_whole_accumulation_batches() -> None:
    ramp = _schedule(
        world=2, local_batch_size=2, global_batch_size=12, global_batch_size_start=4,
        global_batch_size_ramp_steps=4,
    )  # fmt: skip
    assert [ramp.accumulation(s) for s in range(1, 8)] == [1, 1, 2, 2, 3, 3, 3]
    assert [ramp.global_batch(s) for s in range(1, 8)] == [4, 4, 8, 8, 12, 12, 12]
    assert ramp.ramps
    assert ramp.describe(64) == (
        "global batch 4 -> 12 x 64 tokens over steps 1-5 (1 -> 3 accumulation batch(es) of 2 "
        "per rank)"
    )


def test_without_a_ramp_every_step_is_the_global_batch() -> None:
    fixed = _schedule(world=2, local_batch_size=2, global_batch_size=12)
    assert {fixed.accumulation(s) for s in range(1, 50)} == {3}
    assert not fixed.ramps
    assert (
        fixed.describe(64) == "global batch 12 x 64 tokens (3 accumulation batch(es) of 2 per rank)"
    )
    # A start equal to the full batch is no ramp.
    same = _schedule(global_batch_size=8, global_batch_size_start=8, global_batch_size_ramp_steps=5)
    assert not same.ramps and same.batches_through(3) == 3


@pytest.mark.parametrize(
    ("first", "last", "ramp_steps"),
    [c for c in itertools.product([1, 2, 5], [1, 3, 8, 40], [1, 2, 7, 100]) if c[0] <= c[1]],
)
def test_batches_through_is_the_running_total(first: int, last: int, ramp_steps: int) -> None:
    schedule = BatchSchedule(local_batch_size=1, dp_degree=1, first=first, last=last,
                             ramp_steps=ramp_steps)  # fmt: skip
    per_step = [schedule.accumulation(s) for s in range(1, ramp_steps + 20)]
    assert per_step == sorted(per_step)  # never shrinks
    assert per_step[0] == first and per_step[ramp_steps] == last
    assert schedule.batches_through(0) == 0
    for step in range(1, len(per_step) + 1):
        assert schedule.batches_through(step) == sum(per_step[:step]), step


def test_each_increment_lasts_about_the_same_number_of_steps() -> None:
    """1 -> 5 over 8 steps: four increments, two steps at each size below the last."""
    schedule = BatchSchedule(local_batch_size=4, dp_degree=1, first=1, last=5, ramp_steps=8)
    sizes = [schedule.accumulation(s) for s in range(1, 10)]
    assert [sizes.count(n) for n in range(1, 5)] == [2, 2, 2, 2] and sizes[-1] == 5


def test_refusals_name_the_flag() -> None:
    with pytest.raises(ConfigError, match="global_batch_size_start=6 must be a multiple of"):
        _schedule(local_batch_size=4, global_batch_size=16, global_batch_size_start=6,
                  global_batch_size_ramp_steps=3)  # fmt: skip
    with pytest.raises(ConfigError, match="ramp_steps=3 needs --training.global_batch_size_start"):
        _schedule(global_batch_size_ramp_steps=3)


def test_the_eta_weighs_the_steps_left_by_their_batches(monkeypatch, tmp_path) -> None:
    """Two steps of one batch took 2 s; the four left run 2 + 2 + 3 + 3 batches: 10 s, where
    counting steps would say 4 s."""
    import torch

    from torchtitan.components import metrics
    from torchtitan.config.job_config import Metrics

    ramp = BatchSchedule(local_batch_size=2, dp_degree=1, first=1, last=3, ramp_steps=4)
    clock = iter([100.0, 100.0, 102.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    processor = metrics.MetricsProcessor(
        Metrics(), dump_folder=str(tmp_path), device=torch.device("cpu"), flops_per_token=1,
        rank=0, save_rank=False,
    )  # fmt: skip
    processor.start_run(first_step=0, last_step=6, work=ramp.batches_through)
    assert processor._eta_seconds(2) == pytest.approx(10.0)

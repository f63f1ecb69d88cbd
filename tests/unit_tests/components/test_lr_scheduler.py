"""Tests for the warm-up / stable / decay learning-rate schedule."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.lr_scheduler import build_lr_scheduler, describe, lr_factor, schedule
from torchtitan.config.job_config import LRScheduler as LRSchedulerConfig

PEAK_LR = 0.5


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=PEAK_LR)


def _scheduled_lrs(
    config: LRSchedulerConfig, training_steps: int, stages: tuple = ((1, 1),)
) -> list[float]:
    """The LR each optimizer step runs with, in a loop shaped like the trainer's."""
    optimizer = _optimizer()
    scheduler = build_lr_scheduler(optimizer, config, training_steps=training_steps, stages=stages)
    lrs = []
    for _ in range(training_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def _factors(lrs: list[float]) -> list[float]:
    return [lr / PEAK_LR for lr in lrs]


# --- lr_factor ----------------------------------------------------------------------------------


def test_warmup_rises_linearly_from_the_first_step() -> None:
    factors = [
        lr_factor(
            step,
            warmup_steps=4,
            decay_start=4,
            decay_steps=6,
            decay_type="linear",
            min_lr_factor=0.0,
        )
        for step in range(5)
    ]
    # The first decay step already decays one notch (1/6), so the last one reaches the floor.
    assert factors == pytest.approx([0.2, 0.4, 0.6, 0.8, 1 - 1 / 6])


# Decay over steps 10..17 (decay_steps 8; step s has progress (s - 9) / 8) to a floor of 0.1:
# factor = 0.1 + 0.9 * shape(progress).
@pytest.mark.parametrize(
    ("decay_type", "quarter", "middle"),
    [
        ("linear", 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.5),
        ("cosine", 0.1 + 0.9 * 0.5 * (1 + math.sqrt(0.5)), 0.1 + 0.9 * 0.5),
        ("sqrt", 0.1 + 0.9 * 0.5, 0.1 + 0.9 * (1 - math.sqrt(0.5))),
        ("constant", 1.0, 1.0),
    ],
)
def test_decay_shapes(decay_type: str, quarter: float, middle: float) -> None:
    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=2,
            decay_start=10,
            decay_steps=8,
            decay_type=decay_type,
            min_lr_factor=0.1,
        )

    end = 1.0 if decay_type == "constant" else 0.1
    assert factor(9) == 1.0  # stable phase
    assert factor(10) <= 1.0 and (factor(10) < 1.0) == (decay_type != "constant")
    assert factor(11) == pytest.approx(quarter)
    assert factor(13) == pytest.approx(middle)
    assert factor(17) == pytest.approx(end)  # the last decay step uses the floor
    assert factor(30) == pytest.approx(end)  # past the end it stays at the floor


def test_no_decay_steps_means_peak_after_warmup() -> None:
    assert [
        lr_factor(
            s,
            warmup_steps=1,
            decay_start=5,
            decay_steps=0,
            decay_type="linear",
            min_lr_factor=0.0,
        )
        for s in range(5)
    ] == [0.5, 1.0, 1.0, 1.0, 1.0]


# --- build_lr_scheduler -------------------------------------------------------------------------


def test_schedule_warmup_then_stable_then_decay() -> None:
    # 20 steps: warm-up 0..3, decay_ratio 0.5 of the 16 later steps -> stable 4..11, decay 12..19.
    config = LRSchedulerConfig(warmup_steps=4, decay_ratio=0.5, decay_type="linear")
    factors = _factors(_scheduled_lrs(config, training_steps=20))
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4:12] == pytest.approx([1.0] * 8)
    decay = factors[12:]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    assert decay[0] <= 1.0 and decay[-1] < 0.25


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
def test_schedule_never_goes_below_the_floor(decay_type: str) -> None:
    config = LRSchedulerConfig(warmup_steps=2, decay_type=decay_type, min_lr_factor=0.1)
    factors = _factors(_scheduled_lrs(config, training_steps=10))
    assert min(factors[2:]) >= 0.1 - 1e-12
    assert all(a >= b for a, b in zip(factors[2:], factors[3:], strict=False))


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
def test_schedule_reaches_the_floor_at_the_last_step(decay_type: str) -> None:
    config = LRSchedulerConfig(warmup_steps=2, decay_type=decay_type, min_lr_factor=0.1)
    assert _factors(_scheduled_lrs(config, training_steps=10))[-1] == pytest.approx(0.1)


def test_warmup_longer_than_training_is_cut_to_the_run() -> None:
    config = LRSchedulerConfig(warmup_steps=10, min_lr_factor=0.0)
    factors = _factors(_scheduled_lrs(config, training_steps=5))
    assert factors == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6])


def test_no_warmup_starts_at_the_peak() -> None:
    config = LRSchedulerConfig(warmup_steps=0, decay_ratio=0.5, decay_type="linear")
    factors = _factors(_scheduled_lrs(config, training_steps=4))
    assert factors[:2] == pytest.approx([1.0, 1.0])
    assert factors[2] <= 1.0 and factors[3] < factors[2]


@pytest.mark.parametrize(
    "config",
    [
        LRSchedulerConfig(warmup_steps=2, decay_type="constant", min_lr_factor=0.1),
        LRSchedulerConfig(warmup_steps=2, decay_ratio=0.0, decay_type="linear"),
    ],
    ids=["constant", "decay_ratio_0"],
)
def test_schedules_that_hold_the_peak(config: LRSchedulerConfig) -> None:
    factors = _factors(_scheduled_lrs(config, training_steps=8))
    assert factors == pytest.approx([1 / 3, 2 / 3] + [1.0] * 6)


def test_state_dict_round_trip_continues_identically(tmp_path: Path) -> None:
    config = LRSchedulerConfig(warmup_steps=3, decay_type="cosine", min_lr_factor=0.1)
    training_steps, resume_at = 20, 7

    optimizer = _optimizer()
    scheduler = build_lr_scheduler(optimizer, config, training_steps=training_steps)
    for _ in range(resume_at):
        optimizer.step()
        scheduler.step()
    path = tmp_path / "checkpoint.pt"
    torch.save({"optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict()}, path)
    reference = []
    for _ in range(training_steps - resume_at):
        reference.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()

    saved = torch.load(path, weights_only=True)
    fresh_optimizer = _optimizer()
    fresh = build_lr_scheduler(fresh_optimizer, config, training_steps=training_steps)
    assert isinstance(fresh, LambdaLR)
    fresh_optimizer.load_state_dict(saved["optimizer"])
    fresh.load_state_dict(saved["lr_scheduler"])
    assert fresh.last_epoch == resume_at
    assert fresh.get_last_lr() == pytest.approx([reference[0]])
    resumed = []
    for _ in range(training_steps - resume_at):
        resumed.append(fresh_optimizer.param_groups[0]["lr"])
        fresh_optimizer.step()
        fresh.step()
    assert resumed == reference
    assert reference[0] == pytest.approx(
        PEAK_LR
        * lr_factor(
            resume_at,
            warmup_steps=3,
            decay_start=3,
            decay_steps=17,
            decay_type="cosine",
            min_lr_factor=0.1,
        )
    )


def test_the_resume_note_names_what_changed_and_nothing_when_nothing_did():
    from torchtitan.components.lr_scheduler import resumed_schedule_note
    from torchtitan.config.job_config import LRScheduler

    config = LRScheduler(warmup_steps=2)
    same = dict(training_steps=8, lr=1e-3, saved=config, saved_steps=8, saved_lr=1e-3, step=4)
    assert resumed_schedule_note(config, **same) is None
    note = resumed_schedule_note(config, **(same | {"saved_lr": 2e-3}))
    assert "--optimizer.lr 0.002" in note and "--optimizer.lr 0.001" in note
    new, old = map(
        float, re.search(r"trains at lr (\S+) \(the old schedule: (\S+)\)", note).groups()
    )
    assert old == pytest.approx(2 * new)


# --- counted in tokens (--lr_scheduler.unit tokens) ---------------------------------------------

RAMP = ((1, 4), (3, 8), (4, 12))  # 4, 4, 8, 12, 12, 12 sequences per step, the full batch 12


@pytest.mark.parametrize("decay_ratio", [None, 0.3, 0.0])
@pytest.mark.parametrize("warmup", [0, 3, 10, 40])
@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt", "constant"])
def test_tokens_at_a_fixed_batch_are_the_step_schedule(decay_ratio, warmup, decay_type) -> None:
    steps = LRSchedulerConfig(warmup, decay_ratio, decay_type, min_lr_factor=0.1)
    tokens = LRSchedulerConfig(warmup, decay_ratio, decay_type, 0.1, unit="tokens")
    by_steps = schedule(steps, training_steps=37)
    by_tokens = schedule(tokens, training_steps=37, stages=((1, 8),))
    assert [by_tokens(step) for step in range(40)] == [by_steps(step) for step in range(40)]
    assert describe(tokens, training_steps=37, stages=((1, 8),)).replace(
        f", counted in tokens ({min(warmup, 37)} full batches)", ""
    ) == describe(steps, training_steps=37)


def test_under_a_ramp_each_step_takes_the_lr_of_the_tokens_trained() -> None:
    """Step k sits at (sequences through k) / 12 - 1 full batches: -2/3, -1/3, 1/3, 4/3, 7/3,
    10/3 of a run of 52/12; warm-up over 2 full batches, then a linear decay over the other
    7/3 (the first decay step already a notch down, the last at the floor)."""
    config = LRSchedulerConfig(warmup_steps=2, unit="tokens")
    factors = _factors(_scheduled_lrs(config, training_steps=6, stages=RAMP))
    positions = [Fraction(n, 12) - 1 for n in (4, 8, 16, 28, 40, 52)]
    warmup = [(x + 1) / 3 for x in positions[:4]]
    decay = [1 - (x - 2 + 1) / Fraction(7, 3) for x in positions[4:]]
    assert factors == pytest.approx([float(f) for f in warmup + decay])
    assert factors[:2] == pytest.approx([1 / 9, 2 / 9])  # the steps count 1/3 step each
    by_steps = _factors(_scheduled_lrs(LRSchedulerConfig(warmup_steps=2), 6, stages=RAMP))
    assert by_steps[:2] == pytest.approx([1 / 3, 2 / 3])
    assert describe(config, training_steps=6, stages=RAMP) == (
        "warm-up to step 4, counted in tokens (2 full batches), linear decay over steps 5-6"
    )


def test_the_resume_note_counts_a_changed_ramp_only_in_tokens() -> None:
    from torchtitan.components.lr_scheduler import resumed_schedule_note

    fixed = ((1, 12),)
    for unit, note in (("steps", False), ("tokens", True)):
        config = LRSchedulerConfig(warmup_steps=2, unit=unit)
        same = dict(training_steps=6, lr=1e-3, saved=config, saved_steps=6, saved_lr=1e-3, step=2)
        assert resumed_schedule_note(config, **same, stages=RAMP, saved_stages=RAMP) is None
        got = resumed_schedule_note(config, **same, stages=fixed, saved_stages=RAMP)
        assert (got is not None) == note
    assert "warm-up to step 4, counted in tokens" in got
    new, old = map(
        float, re.search(r"trains at lr (\S+) \(the old schedule: (\S+)\)", got).groups()
    )
    # Step 3 at a fixed 12: 36 sequences, the first notch of a decay over 4 full batches; under
    # the ramp: 16 sequences, 4/9 of the way through the warm-up.
    assert (new, old) == pytest.approx((1e-3 * 3 / 4, 1e-3 * 4 / 9), rel=1e-3)


def _phases(text: str) -> tuple[int, int | None]:
    """The last warm-up step and the first decay step a :func:`describe` line names."""
    warmup = re.search(r"warm-up to step (\d+)", text)
    decay = re.search(r"decay over steps (\d+)-(\d+)", text)
    return (int(warmup[1]) if warmup else 0), (int(decay[1]) if decay else None)


def test_under_a_ramp_the_phases_are_where_the_log_says_and_the_curve_is_whole() -> None:
    """300 random ramps and schedules counted in tokens: warm-up rises to the step the start-up
    line names, the decay starts at the step it names (none lost to rounding, none inside the
    warm-up) and ends at the floor on the last step; nothing is named past the run."""
    for seed in range(300):
        _check_phases(seed)


def _check_phases(seed: int) -> None:
    import random

    from torchtitan.components.batch_schedule import ramp_stages

    rng = random.Random(seed)
    full = rng.choice([8, 12, 30, 64])
    start = rng.choice([d for d in range(1, full) if full % d == 0])
    stages = ramp_stages(start, start, full, rng.randint(1, 40 * full))
    steps = rng.randint(2, 60)
    config = LRSchedulerConfig(
        warmup_steps=rng.randint(0, 12), decay_ratio=rng.choice([None, 0.0, 0.3, 0.5, 1.0]),
        decay_type="linear", unit="tokens",
    )  # fmt: skip
    f = [schedule(config, training_steps=steps, stages=stages)(k) for k in range(steps)]
    last_warmup, first_decay = _phases(describe(config, training_steps=steps, stages=stages))
    case = (seed, stages, steps, config)
    assert 0 <= last_warmup <= steps and (first_decay is None or first_decay <= steps), case
    assert all(0.0 <= x <= 1.0 for x in f), case
    warm = f[:last_warmup]
    assert all(a < b for a, b in zip(warm, warm[1:], strict=False)), case
    assert all(x < 1 for x in warm), case
    if first_decay is None:
        assert all(x == 1.0 for x in f[last_warmup:]), case
        return
    assert first_decay > last_warmup, case
    assert all(x == 1.0 for x in f[last_warmup : first_decay - 1]), case  # the stable phase
    decay = f[first_decay - 1 :]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False)) and decay[0] < 1, case
    assert f[-1] == 0.0, case  # the floor, on the last step


def test_no_warm_up_under_a_ramp_starts_at_the_peak() -> None:
    config = LRSchedulerConfig(warmup_steps=0, decay_ratio=0.0, unit="tokens")
    assert _factors(_scheduled_lrs(config, 6, stages=RAMP)) == [1.0] * 6
    assert describe(config, training_steps=6, stages=RAMP) == "no warm-up"

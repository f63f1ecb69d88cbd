"""Learning-rate schedule: linear warm-up, a stable phase, then a decay to ``min_lr_factor``."""

import dataclasses
import functools
import math
import warnings
from fractions import Fraction
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.batch_schedule import sequences_through, stages_for, step_reaching
from torchtitan.components.optimizer import Optimizers
from torchtitan.config.job_config import LRScheduler as LRSchedulerConfig


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    decay_start: int,
    decay_steps: int,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak LR for the ``step``-th optimizer step (0-based).

    Warm-up rises as ``(step + 1) / (warmup_steps + 1)`` so the first step already trains;
    the decay counts the same way, so the last of ``decay_steps`` steps uses the floor.
    """
    # (Counted in tokens, a position is below 0 before the first full batch's worth: without
    # warm-up that is the peak, as for any position before the decay.)
    if warmup_steps and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # constant
        shape = 1.0
    return min_lr_factor + (1.0 - min_lr_factor) * shape


Stages = tuple[tuple[int, int], ...]
"""A run's global batches as ``(first step, sequences)`` (:mod:`batch_schedule`)."""
FIXED: Stages = ((1, 1),)


def position(step: int, stages: Stages) -> Fraction:
    """Where the ``step``-th optimizer step (0-based) sits counted in tokens, in full batches:
    the sequences trained through it over the full batch, less one (at a fixed batch, ``step``
    itself). Exact, so that no step falls on either side of a phase's start by rounding."""
    return Fraction(sequences_through(stages, step + 1), stages[-1][1]) - 1


def lr_factor_in_tokens(step: int, *, stages: Stages, **curve: Any) -> float:
    """:func:`lr_factor` at :func:`position` ``(step)``."""
    return float(lr_factor(position(step, stages), **curve))


def schedule(
    config: LRSchedulerConfig, *, training_steps: int, stages: Stages = FIXED
) -> functools.partial:
    """The LR multiplier of each (0-based) step of a ``training_steps`` run; picklable.
    ``stages``: the run's global batches, which ``--lr_scheduler.unit tokens`` counts in."""
    length: int | Fraction = training_steps
    if config.unit == "tokens":  # in full batches
        length = position(training_steps - 1, stages) + 1
    warmup = min(config.warmup_steps, length)
    after_warmup = length - warmup
    decay = after_warmup
    if config.decay_ratio is not None:  # whole steps (full batches), at most what is left
        decay = min(round(float(after_warmup) * config.decay_ratio), after_warmup)
    curve = dict(
        warmup_steps=warmup,
        decay_start=length - decay,
        decay_steps=decay,
        decay_type=config.decay_type,
        min_lr_factor=config.min_lr_factor,
    )
    if config.unit == "tokens":
        return functools.partial(lr_factor_in_tokens, stages=stages, **curve)
    return functools.partial(lr_factor, **curve)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    config: LRSchedulerConfig,
    *,
    training_steps: int,
    stages: Stages = FIXED,
) -> LambdaLR:
    """A ``LambdaLR`` over ``training_steps``; its state_dict is picklable (no lambdas)."""
    return LambdaLR(optimizer, schedule(config, training_steps=training_steps, stages=stages))


def describe(config: LRSchedulerConfig, *, training_steps: int, stages: Stages = FIXED) -> str:
    """Where the schedule's phases fall, in steps (1-based), for the log."""
    fn = schedule(config, training_steps=training_steps, stages=stages)
    warmup, start = fn.keywords["warmup_steps"], fn.keywords["decay_start"]
    decay = fn.keywords["decay_steps"]
    # The last warm-up step and the first decay step (1-based): the steps whose positions fall
    # below the warm-up's end and from the decay's start on, as lr_factor compares them.
    tokens = ""
    if config.unit == "tokens":
        full = stages[-1][1]
        if warmup:
            tokens = f", counted in tokens ({float(warmup):g} full batches)"
        last_warmup = step_reaching(stages, (warmup + 1) * full) - 1 if warmup else 0
        first_decay = step_reaching(stages, (start + 1) * full)
    else:
        last_warmup, first_decay = warmup, start + 1
    last_warmup = min(last_warmup, training_steps)
    phases = [f"warm-up to step {last_warmup}{tokens}" if last_warmup else "no warm-up"]
    if decay and first_decay <= training_steps:
        phases.append(f"{config.decay_type} decay over steps {first_decay}-{training_steps}")
    return ", ".join(phases)


def resumed_schedule_note(
    config: LRSchedulerConfig,
    *,
    training_steps: int,
    lr: float,
    saved: LRSchedulerConfig,
    saved_steps: int,
    saved_lr: float,
    step: int,
    stages: Stages = FIXED,
    saved_stages: Stages = FIXED,
) -> str | None:
    """The rule on resume: the schedule follows this run's flags (``--optimizer.lr``,
    ``--training.steps``, ``--lr_scheduler.*``, and the batch flags when it counts tokens),
    recomputed from step 1. When the checkpoint's run had others, one line says so, with the
    LR of the next step under both; ``None`` when nothing changed."""
    now = dict(training_steps=training_steps, stages=stages)
    then = dict(training_steps=saved_steps, stages=saved_stages)
    a, b = (_as_curve(c, st) for c, st in ((config, stages), (saved, saved_stages)))
    a, b = schedule(a, **now), schedule(b, **then)
    if saved_lr == lr and (a.func, a.keywords) == (b.func, b.keywords):
        return None
    new = lr * schedule(config, **now)(step)
    old = saved_lr * schedule(saved, **then)(step)
    return (
        f"LR schedule: the checkpoint's run had --optimizer.lr {saved_lr:g} --training.steps "
        f"{saved_steps} ({describe(saved, **then)}); this run follows its own flags, "
        f"--optimizer.lr {lr:g} --training.steps {training_steps} ({describe(config, **now)}): "
        f"step {step + 1} trains at lr {new:.3e} (the old schedule: {old:.3e}). Resume with "
        "the old values to keep the old curve"
    )


def _as_curve(config: LRSchedulerConfig, stages: Stages) -> LRSchedulerConfig:
    """``config`` as a curve to compare: at a fixed batch tokens count as steps."""
    return dataclasses.replace(config, unit="steps") if len(stages) == 1 else config


def resumed_note_for(current: Any, saved: Any, step: int, stages: Stages = FIXED) -> str | None:
    """:func:`resumed_schedule_note` between two ``JobConfig``s (``saved``: the checkpoint's
    run's, None when unknown; ``stages``: this run's batches; the saved run's are those of its
    flags at this run's full batch where it left the batch to the layout)."""
    if saved is None or current.validation.only:  # (a validation-only run trains nothing)
        return None
    full = stages[-1][1]
    if saved.training.global_batch_size != -1:
        full = saved.training.global_batch_size
    return resumed_schedule_note(
        current.lr_scheduler, training_steps=current.training.steps, lr=current.optimizer.lr,
        saved=saved.lr_scheduler, saved_steps=saved.training.steps, saved_lr=saved.optimizer.lr,
        step=step, stages=stages, saved_stages=stages_for(saved.training, full),
    )  # fmt: skip


class LRSchedulers(Stateful):
    """One schedule per optimizer of :class:`Optimizers`, all the same curve, stepped together.

    Checkpointed as a single ``LambdaLR`` state (they are identical), so a checkpoint written
    with any number of model parts loads into any other.
    """

    def __init__(self, schedulers: list[LambdaLR], lr_scales: list[list[float]] | None = None):
        self.schedulers = schedulers
        self.span: dict[str, Any] = dict(config=LRSchedulerConfig(), training_steps=0)
        """What :func:`describe` takes: the schedule's config and what it spans."""
        # Each optimizer's param groups' factors of the peak LR (--optimizer.param_groups).
        self.lr_scales = lr_scales or [[1.0] * len(s.optimizer.param_groups) for s in schedulers]

    def step(self, *, skipped: bool = False) -> None:
        """Move to the next step's LR. ``skipped``: the step updated nothing
        (``--training.skip_steps``)."""
        with warnings.catch_warnings():
            if skipped:  # torch's note on a schedule stepping before its optimizer ever has
                # (a skipped step 1): it leaves out the first value, as skipping it should.
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step")
            for scheduler in self.schedulers:
                scheduler.step()

    def describe(self) -> str:
        """Where the schedule's phases fall, in steps, for the log."""
        return describe(**self.span)

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def factor(self) -> float:
        """The curve's factor of the peak LR for the next step (what ``--optimizer.lr`` is
        multiplied by; groups with an ``lr_scale`` take that too)."""
        scheduler = self.schedulers[0]
        return scheduler.lr_lambdas[0](scheduler.last_epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def reapply(self, peak_lr: float) -> None:
        """Set every optimizer's LR from this run's curve and ``--optimizer.lr`` at the loaded
        position: the loaded state carries the saving run's peak LR and the LR its curve chose
        for the next step. (Same flags: the same values, bit for bit.)"""
        for scheduler, scales in zip(self.schedulers, self.lr_scales, strict=True):
            scheduler.base_lrs = [peak_lr * scale for scale in scales]
            lrs = [
                base * fn(scheduler.last_epoch)
                for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
            ]
            for group, base, lr in zip(
                scheduler.optimizer.param_groups, scheduler.base_lrs, lrs, strict=True
            ):
                group["initial_lr"] = base
                group["lr"] = lr
            scheduler._last_lr = lrs

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved position; call :meth:`reapply` next (the per-group values of the saving
        run's first optimizer, which may have had other groups, are replaced there)."""
        for scheduler in self.schedulers:
            # The curve is this run's (a function, nothing to restore); the saved list has one
            # entry per param group of the saving run's first optimizer.
            lambdas = [None] * len(scheduler.lr_lambdas)
            scheduler.load_state_dict(dict(state_dict) | {"lr_lambdas": lambdas})


def build_lr_schedulers(
    optimizers: Optimizers,
    config: LRSchedulerConfig,
    training_steps: int,
    stages: Stages = FIXED,
) -> LRSchedulers:
    """One schedule per optimizer over ``training_steps`` steps of ``stages``' global batches."""
    schedulers = LRSchedulers(
        [
            build_lr_scheduler(optimizer, config, training_steps=training_steps, stages=stages)
            for optimizer in optimizers.optimizers
        ],
        optimizers.lr_scales(),
    )
    schedulers.span = dict(config=config, training_steps=training_steps, stages=stages)
    return schedulers

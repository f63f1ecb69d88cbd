"""Learning-rate schedule: linear warm-up, a stable phase, then a decay to ``min_lr_factor``."""

import functools
import math
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LambdaLR

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
    if step < warmup_steps:
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


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: LRSchedulerConfig, *, training_steps: int
) -> LambdaLR:
    """A ``LambdaLR`` over ``training_steps``; its state_dict is picklable (no lambdas)."""
    warmup = min(config.warmup_steps, training_steps)
    after_warmup = training_steps - warmup
    decay_ratio = 1.0 if config.decay_ratio is None else config.decay_ratio
    decay_steps = round(after_warmup * decay_ratio)
    fn = functools.partial(
        lr_factor,
        warmup_steps=warmup,
        decay_start=training_steps - decay_steps,
        decay_steps=decay_steps,
        decay_type=config.decay_type,
        min_lr_factor=config.min_lr_factor,
    )
    return LambdaLR(optimizer, fn)


class LRSchedulers(Stateful):
    """One schedule per optimizer of :class:`Optimizers`, all the same curve, stepped together.

    Checkpointed as a single ``LambdaLR`` state (they are identical), so a checkpoint written
    with any number of model parts loads into any other.
    """

    def __init__(self, schedulers: list[LambdaLR]):
        self.schedulers = schedulers

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(dict(state_dict))


def build_lr_schedulers(
    optimizers: Optimizers, config: LRSchedulerConfig, *, training_steps: int
) -> LRSchedulers:
    return LRSchedulers(
        [
            build_lr_scheduler(optimizer, config, training_steps=training_steps)
            for optimizer in optimizers.optimizers
        ]
    )

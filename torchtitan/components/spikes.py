"""Skipping the update of a step whose loss or gradient norm spikes (``--training.spike_sigma``).

A step spikes when its loss, or its gradient norm before clipping, is more than
``spike_sigma`` standard deviations above the mean of the previous ``spike_window`` steps' (as
OLMo-core's skip-step optimizers judge it). Its gradients are dropped; its data is spent, the LR
schedule moves on, and its values join the window, so that a lasting change of level (a new
data mix) stops counting as a spike after a few steps instead of skipping every step. No step
is judged before the window is full. Both values are global, and the ranks agree on the verdict
(one flag on the host), so every rank takes the same branch. The window is checkpointed, so a
resumed run judges its steps as the uninterrupted one would.
"""

import collections
import json
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.components.train_state import StepResult
from torchtitan.config.job_config import Training
from torchtitan.distributed import local_tensor


class SpikeGuard(Stateful):
    """The window of the last steps' losses and gradient norms, and the verdict on the next."""

    def __init__(self, sigma: float, window: int, loss_mesh: DeviceMesh | None = None):
        self.sigma, self.window, self.loss_mesh = sigma, window, loss_mesh
        self.history = {
            "loss": collections.deque(maxlen=window),
            "gradient norm": collections.deque(maxlen=window),
        }
        self.skipped = 0

    @classmethod
    def from_config(cls, t: Training, loss_mesh: DeviceMesh | None) -> "SpikeGuard | None":
        """The guard of ``--training.spike_sigma`` (``None``: off)."""
        return cls(t.spike_sigma, t.spike_window, loss_mesh) if t.spike_sigma > 0 else None

    def judge(self, step: int, result: StepResult) -> str | None:
        """The warning line when ``step`` (finite) spikes, its update to be skipped; ``None``
        when it trains. Its values join the window either way."""
        loss = result.global_loss(self.loss_mesh)
        return self.judge_values(step, loss, result.grad_norm.item(), agree=_any_rank)

    def judge_values(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        *,
        agree: Callable[[bool], bool] = bool,
    ) -> str | None:
        """:meth:`judge` on the step's global loss and gradient norm. ``agree``: this rank's
        verdict to the job's (every rank must take the same branch: their values are equal,
        but a comparison at the threshold must not depend on it)."""
        found = []
        for (name, history), value in zip(self.history.items(), (loss, grad_norm), strict=True):
            if len(history) == self.window:
                mean = math.fsum(history) / self.window
                std = math.sqrt(math.fsum((v - mean) ** 2 for v in history) / self.window)
                if std > 0 and value > mean + self.sigma * std:
                    found.append(
                        f"{name} {value:.4g} is {(value - mean) / std:.1f} standard deviations "
                        f"above the last {self.window} steps' mean {mean:.4g}"
                    )
            history.append(value)
        if not agree(bool(found)):
            return None
        self.skipped += 1
        why = (
            "; ".join(found)
            or "another rank's values spiked (equal to this rank's but for rounding)"
        )
        return (
            f"Step {step}: {why}: update skipped as a spike (--training.spike_sigma "
            f"{self.sigma:g}; {self.skipped} so far)"
        )

    def state_dict(self) -> dict[str, Any]:
        # One string: a window of any length loads into any other run's (DCP needs the shapes
        # of tensors to match), and every rank holds the same one.
        state = {name: list(values) for name, values in self.history.items()}
        return {"window": json.dumps(state | {"skipped": self.skipped})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = json.loads(state_dict["window"])
        self.skipped = state.pop("skipped")
        for name, values in state.items():
            self.history[name].clear()
            self.history[name].extend(values)  # the newest ``window`` of them


def _any_rank(spikes: bool) -> bool:
    """Whether any rank of the job found a spike: a flag on the host, summed through gloo
    (``cpu:gloo,cuda:nccl``: no GPU wait). Simulated ranks share this process's values."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or local_tensor.is_simulating():
        return spikes
    flag = torch.tensor(float(spikes))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)

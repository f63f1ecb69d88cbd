"""Optimizers built from the ``optimizer`` config section: one per model part.

A pipeline-parallel rank holds several model parts (stages); without pipelining there is one.
Each part gets its own optimizer because DCP's optimizer state-dict API pairs an optimizer
with the module holding its parameters; the state dicts use flattened, fully qualified names
(``state.layers.3.attention.wq.weight.exp_avg``), so the parts' states merge into one dict that
loads into any other split of the same model (one part, or other stages).
"""

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import Optimizer as OptimizerConfig

_CLASSES = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Optimizers(Stateful):
    """The optimizers of this rank's model parts, stepped and checkpointed together."""

    def __init__(
        self, model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
    ):
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers)
        self._post_step_hooks: list[Callable[[], object]] = []

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()
        for hook in self._post_step_hooks:
            hook()

    def register_step_post_hook(self, hook: Callable[[], object]) -> None:
        """Call ``hook()`` after every step of all the optimizers (e.g. float8 weight scales
        computed from the new weights)."""
        self._post_step_hooks.append(hook)

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def state_tensors(self) -> Iterator[Any]:
        """Every value of every optimizer's per-parameter state (moments, step counts)."""
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                yield from state.values()

    @property
    def has_state(self) -> bool:
        """Whether a step has created the per-parameter state (Adam's moments)."""
        return any(optimizer.state for optimizer in self.optimizers)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            merged.update(get_optimizer_state_dict(part, optimizer, options=_FLAT))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            set_optimizer_state_dict(part, optimizer, state_dict, options=_FLAT)


def build_optimizers(
    model_parts: Sequence[nn.Module], config: OptimizerConfig, device: torch.device
) -> Optimizers:
    """One optimizer per model part; call it after sharding so states are sharded too."""
    return Optimizers(model_parts, [build_optimizer(part, config, device) for part in model_parts])


def build_optimizer(
    model: nn.Module, config: OptimizerConfig, device: torch.device
) -> torch.optim.Optimizer:
    """Build over ``model``'s parameters; call it after sharding so states are sharded too.

    ``implementation=auto`` picks the fused kernel (CUDA and CPU have one) and falls back to
    ``foreach`` on other devices.
    """
    implementation = config.implementation
    if implementation == "auto":
        implementation = "fused" if device.type in ("cuda", "cpu") else "foreach"
    # Fused and foreach kernels cannot mix DTensors with plain tensors (e.g. norms left
    # replicated by a TP plan without sequence parallelism): one param group per kind.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": kind}
        for kind in (
            [p for p in params if isinstance(p, DTensor)],
            [p for p in params if not isinstance(p, DTensor)],
        )
        if kind
    ]
    return _CLASSES[config.name](
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=implementation == "fused",
        foreach=implementation == "foreach",
    )

"""Optimizers built from the ``optimizer`` config section: one per model part.

A pipeline-parallel rank holds several model parts (stages); without pipelining there is one.
Each part gets its own optimizer because DCP's optimizer state-dict API pairs an optimizer
with the module holding its parameters; the state dicts use flattened, fully qualified names
(``state.layers.3.attention.wq.weight.exp_avg``), so the parts' states merge into one dict that
loads into any other split of the same model (one part, or other stages).
"""

import re
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

from torchtitan.components.muon import Muon, muon_takes
from torchtitan.components.stochastic_rounding import RoundedAdam, RoundedAdamW, Rounding
from torchtitan.config.entries import ParamGroup
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.tools.logging import logger
from torchtitan.tools.module_names import clean_name

_CLASSES = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}
_ROUNDED = {"AdamW": RoundedAdamW, "Adam": RoundedAdam}
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Optimizers(Stateful):
    """The optimizers of this rank's model parts, stepped and checkpointed together."""

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        settings: Sequence[list[ParamGroup | None]] | None = None,
        parts: Sequence[int] | None = None,
    ):
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers)
        # The model part each optimizer steps (a part may have two: Muon and AdamW).
        self.parts = list(parts) if parts is not None else list(range(len(self.optimizers)))
        if len(self.parts) != len(self.optimizers) or not all(
            0 <= p < len(self.model_parts) for p in self.parts
        ):
            raise ValueError(f"parts {self.parts} do not map {len(self.optimizers)} optimizers "
                             f"to {len(self.model_parts)} model parts")  # fmt: skip
        # Each optimizer's param groups' --optimizer.param_groups entries (None: the section's).
        self.settings = (
            [list(s) for s in settings]
            if settings is not None
            else [[None] * len(o.param_groups) for o in self.optimizers]
        )
        self._post_step_hooks: list[Callable[[], object]] = []
        self._steps = 0
        self.replica_key: str | None = None
        """Semi-synchronous training: each replica's moments are its own, checkpointed under
        this key (``replica<r>``) so the replicas' states do not collapse into one."""

    def step(self, train_step: int | None = None) -> None:
        """Step every optimizer; ``train_step`` (default: one more than the last) keys the
        random bits of stochastic rounding, so a resumed run draws the bits it would have."""
        self._steps = train_step if train_step is not None else self._steps + 1
        for optimizer in self.optimizers:
            rounding = getattr(optimizer, "rounding", None)
            if rounding is not None:
                rounding.step = self._steps
            optimizer.step()
        self.weights_changed()

    def weights_changed(self) -> None:
        """Run what follows a step (the post-step hooks) after the weights changed; also
        called when they change outside a step (a semi-synchronous sync)."""
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

    def _by_part(self) -> Iterator[tuple[nn.Module, list[torch.optim.Optimizer]]]:
        for index, part in enumerate(self.model_parts):
            yield part, [o for o, p in zip(self.optimizers, self.parts, strict=True) if p == index]

    def state_dict(self) -> dict[str, Any]:
        merged = self.flat_state_dict()
        return merged if self.replica_key is None else {self.replica_key: merged}

    def flat_state_dict(self) -> dict[str, Any]:
        """The state under the parameters' names (whatever ``replica_key`` says)."""
        merged: dict[str, Any] = {}
        for part, optimizers in self._by_part():
            merged.update(get_optimizer_state_dict(part, optimizers, options=_FLAT))
        return merged

    def lr_scales(self) -> list[list[float]]:
        """Each optimizer's param groups' factors of ``--optimizer.lr``."""
        return [[e.lr_scale if e is not None else 1.0 for e in s] for s in self.settings]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the moments; every setting stays this run's (a checkpoint stores the saving
        run's with each parameter: weight decay, betas, eps, the kernel, Adam or AdamW;
        ``LRSchedulers.reapply`` sets the learning rates)."""
        if self.replica_key is not None and self.replica_key in state_dict:
            state_dict = state_dict[self.replica_key]
        for part, optimizers in self._by_part():
            groups = [group for optimizer in optimizers for group in optimizer.param_groups]
            settings = [{k: v for k, v in group.items() if k != "params"} for group in groups]
            set_optimizer_state_dict(part, optimizers, state_dict, options=_FLAT)
            groups = [group for optimizer in optimizers for group in optimizer.param_groups]
            for group, own in zip(groups, settings, strict=True):
                group.update(own)


def build_optimizers(
    model_parts: Sequence[nn.Module],
    config: OptimizerConfig,
    device: torch.device,
    *,
    seed: int | None = None,
) -> Optimizers:
    """The optimizers of each model part (one; two with Muon: Muon and AdamW); call it after
    sharding so states are sharded too. ``seed``: of stochastic rounding's bits
    (``--debug.seed``; None: 0)."""
    optimizers, settings, parts = [], [], []
    for index, part in enumerate(model_parts):
        for optimizer, groups in build_optimizer(part, config, device, seed=seed):
            optimizers.append(optimizer)
            settings.append(groups)
            parts.append(index)
    return Optimizers(model_parts, optimizers, settings, parts)


def build_optimizer(
    model: nn.Module, config: OptimizerConfig, device: torch.device, *, seed: int | None = None
) -> list[tuple[torch.optim.Optimizer, list[ParamGroup | None]]]:
    """Build over ``model``'s trainable parameters, grouped by ``--optimizer.param_groups``;
    call it after sharding so states are sharded too. Returns each optimizer (Adam or AdamW;
    with Muon, Muon for the blocks' matrices and AdamW for the rest) with each of its param
    groups' entry (``None``: the section's own settings).

    ``implementation=auto`` picks the fused kernel (CUDA and CPU have one) and falls back to
    ``foreach`` on other devices. With ``stochastic_rounding`` the Adam step is computed per
    parameter in float32 instead (``stochastic_rounding.adam_step_``), seeded by ``seed``.
    """
    implementation = config.implementation
    if implementation == "auto":
        implementation = "fused" if device.type in ("cuda", "cpu") else "foreach"
    entries = config.groups()
    patterns = [re.compile(entry.pattern) for entry in entries]
    muon = config.name == "Muon"
    # [uses Muon][entry index]: the parameters of each param group
    members: list[list[list[nn.Parameter]]] = [
        [[] for _ in range(len(entries) + 1)] for _ in (0, 1)
    ]
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            name = clean_name(name)
            names[id(param)] = name
            first = next((i for i, p in enumerate(patterns) if p.search(name)), len(entries))
            members[muon and muon_takes(name, param)][first].append(param)
    built = []
    for uses_muon, by_entry in enumerate(members):
        groups, settings = [], []
        for entry, params in zip([*entries, None], by_entry, strict=True):
            # Fused and foreach kernels cannot mix DTensors with plain tensors (e.g. norms left
            # replicated by a TP plan without sequence parallelism): one param group per kind.
            for kind in (
                [p for p in params if isinstance(p, DTensor)],
                [p for p in params if not isinstance(p, DTensor)],
            ):
                if kind:
                    hyper = _hyperparameters(entry, config)
                    if uses_muon:
                        hyper = {k: hyper[k] for k in ("lr", "weight_decay")}
                    groups.append({"params": kind, **hyper})
                    settings.append(entry)
        if not groups:
            continue
        rounding = Rounding(seed or 0, names) if config.stochastic_rounding else None
        if uses_muon:
            optimizer = Muon(
                groups, lr=config.lr, momentum=config.muon_momentum,
                weight_decay=config.weight_decay, ns_steps=config.muon_ns_steps,
                ns_dtype=getattr(torch, config.muon_ns_dtype), rounding=rounding,
            )  # fmt: skip
        else:
            adam = "AdamW" if muon else config.name
            kind = {"rounding": rounding} if rounding is not None else {}
            optimizer = (_ROUNDED if rounding is not None else _CLASSES)[adam](
                groups,
                **kind,
                lr=config.lr,
                betas=(config.beta1, config.beta2),
                eps=config.eps,
                weight_decay=config.weight_decay,
                fused=implementation == "fused",
                foreach=implementation == "foreach",
            )
        built.append((optimizer, settings))
    return built


def _hyperparameters(entry: ParamGroup | None, config: OptimizerConfig) -> dict[str, Any]:
    """A param group's settings: ``entry``'s, else the section's."""
    source = entry if entry is not None else config
    lr_scale = entry.lr_scale if entry is not None else 1.0
    return {
        "lr": config.lr * lr_scale,
        "betas": (source.beta1, source.beta2),
        "eps": source.eps,
        "weight_decay": source.weight_decay,
    }


def check_param_groups(model: nn.Module, config: OptimizerConfig) -> None:
    """Refuse a ``--optimizer.param_groups`` entry that no trainable parameter of ``model``
    (the whole model, before a pipeline split) would take: a typo, or every parameter it
    names claimed by an earlier entry. Logs what each entry takes."""
    entries = config.groups()
    if not entries:
        return
    patterns = [re.compile(entry.pattern) for entry in entries]
    taken: list[list[str]] = [[] for _ in entries]
    names = [clean_name(n) for n, p in model.named_parameters() if p.requires_grad]
    for name in names:
        first = next((i for i, p in enumerate(patterns) if p.search(name)), None)
        if first is not None:
            taken[first].append(name)
    for raw, names_taken in zip(config.param_groups, taken, strict=True):
        if not names_taken:
            hint = ", ".join(names[:4] + (["..."] if len(names) > 4 else []))
            raise ConfigError(
                f"--optimizer.param_groups {raw!r}: no trainable parameter takes it (its regex "
                f"matches none, or an earlier entry took them); parameter names: {hint}"
            )
        logger.info(
            f"Optimizer group {raw!r}: {len(names_taken)} parameter tensor(s), e.g. "
            f"{names_taken[0]}"
        )


def changed_settings_note(current: OptimizerConfig, saved: OptimizerConfig | None) -> str | None:
    """A note when a resumed run's optimizer settings differ from the checkpoint's run's:
    this run's apply from the next step (the loaded moments are kept)."""
    if saved is None:
        return None
    fields = (
        "name", "implementation", "weight_decay", "beta1", "beta2", "eps", "muon_momentum",
        "muon_ns_steps", "muon_ns_dtype", "stochastic_rounding", "param_groups",
    )  # fmt: skip
    changed = [
        f"--optimizer.{f} {getattr(saved, f)} -> {getattr(current, f)}"
        for f in fields
        if getattr(saved, f) != getattr(current, f)
    ]
    if not changed:
        return None
    return (
        f"Optimizer settings differ from the checkpoint's run ({'; '.join(changed)}): this "
        "run's apply from the next step"
    )

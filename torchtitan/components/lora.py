"""Low-rank adapters (LoRA): fine-tune a pretrained model by training two small matrices beside
chosen linear layers while every original weight stays frozen.

An adapted layer computes ``x W^T + b + (alpha / r) (x A^T) B^T`` with ``A: [r, in]`` and
``B: [out, r]``. ``B`` starts at zero, so the adapted model starts as the pretrained one; ``A``
starts as a linear layer's default (Kaiming-uniform). The adapters are parameters of the layer
itself (``layers.0.attention.wq.lora_a``), so checkpoints, resharding and pipeline splits treat
them like any other weight; the layer's ``weight`` keeps its name and its HF mapping.

Each family's ``parallelize`` adds them (:func:`add_adapters`) after tensor, context and expert
parallelism and before activation checkpointing, compile and FSDP: every adapter is placed from
its layer's weight, so it works under any TP plan without a style of its own. A column-parallel
weight (``Shard(0)``: each rank its output rows) gets a replicated ``A`` and a ``B`` sharded
like it, a row-parallel one (``Shard(1)``) an ``A`` sharded over the input columns and a
replicated ``B``: the adapter's output is then placed like the layer's (split over the outputs,
or partial sums reduced with them), and adds no collective. FSDP then shards adapters and
frozen weights alike; only the adapters have gradients and optimizer state.
"""

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import LoRA
from torchtitan.tools.module_names import clean_name

ADAPTER_NAMES = ("lora_a", "lora_b")


class _LoRAMixin:
    """Adds the low-rank update to a linear layer's forward (placed before the layer's own
    class in the MRO of :func:`_lora_class`)."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    lora_scale: float

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = super().forward(input)  # type: ignore[misc]
        return out + self.lora_scale * F.linear(F.linear(input, self.lora_a), self.lora_b)


_classes: dict[type, type] = {}  # registry: one adapted class per linear class


def _lora_class(cls: type) -> type:
    """``cls`` (``nn.Linear`` or a subclass such as torchao's float8 linear) with adapters."""
    if cls not in _classes:
        _classes[cls] = type(f"LoRA{cls.__name__}", (_LoRAMixin, cls), {})
    return _classes[cls]


def is_adapted(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer with adapters."""
    return isinstance(module, _LoRAMixin)


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name (``...wq.lora_a``) is an adapter's."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def _targeted(name: str, targets: list[str]) -> bool:
    """``name`` (a module's, wrappers removed) is one of ``targets`` (names or dotted name
    suffixes), or with no targets a linear layer inside the blocks other than an MoE router."""
    if targets:
        return any(name == t or name.endswith("." + t) for t in targets)
    parts = name.split(".")
    return parts[0] == "layers" and "router" not in parts


def targets(model: nn.Module, config: LoRA) -> dict[str, nn.Linear]:
    """``model``'s linear layers that ``config`` adapts, by name; a target name that matches
    none is a ``ConfigError`` (call it on the whole model, before a pipeline split)."""
    modules = {clean_name(n): m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    linear = list(modules)
    chosen = {n: modules[n] for n in linear if _targeted(n, config.targets())}
    for t in config.targets():
        if not any(n == t or n.endswith("." + t) for n in linear):
            names = sorted({n.split(".", 2)[-1] if n.startswith("layers.") else n for n in linear})
            raise ConfigError(
                f"--lora.target_modules {t}: no linear layer of this model is named so; "
                f"its linear layers: {', '.join(names)}"
            )
    if not chosen:
        raise ConfigError("--lora.rank: this model has no linear layer to adapt")
    # A weight two modules share (a tied output projection is the embedding table): the
    # adapter could not be folded into one without changing the other.
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    for name, module in chosen.items():
        if uses.get(id(module.weight), 0) > 1:
            raise ConfigError(
                f"--lora.target_modules: {name} shares its weight with another module (this "
                "flavor ties the output projection to the embeddings), so its adapter could not "
                f"be folded into an export; leave {name} out"
            )
    return chosen


def _adapter_placement(weight: Placement, which: str) -> Placement:
    """The placement of adapter ``which`` (``lora_a`` or ``lora_b``) on a mesh dimension where
    the layer's weight has ``weight``."""
    if weight.is_replicate():
        return Replicate()
    if isinstance(weight, Shard) and weight.dim in (0, 1):
        # Shard(0): outputs split, B follows them; Shard(1): inputs split, A follows them.
        follows = "lora_b" if weight.dim == 0 else "lora_a"
        return Shard(weight.dim) if which == follows else Replicate()
    raise ConfigError(
        f"--lora.rank: an adapted layer's weight is placed {weight} over a mesh, which LoRA "
        "cannot follow; leave that layer out of --lora.target_modules"
    )


def _new_parameter(weight: torch.Tensor, shape: tuple[int, int], which: str) -> nn.Parameter:
    """An uninitialised adapter of global ``shape`` on ``weight``'s device and dtype, placed
    from ``weight``'s placements where it is a DTensor."""
    full = torch.empty(shape, device=weight.device, dtype=weight.dtype)
    if isinstance(weight, DTensor):
        placements = [_adapter_placement(p, which) for p in weight.placements]
        full = distribute_tensor(full, weight.device_mesh, placements, src_data_rank=None)
    return nn.Parameter(full)


def add_adapters(model: nn.Module, config: LoRA) -> nn.Module:
    """Give the targeted linear layers of ``model`` (a whole model or a pipeline stage, built
    on meta, perhaps tensor-parallel) adapters of ``config.rank``, and freeze every other
    parameter. No-op with ``--lora.rank 0``. Initialise them with :func:`init_adapters`."""
    if config.rank <= 0:
        return model
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or is_adapted(module):
            continue
        if not _targeted(clean_name(name), config.targets()):
            continue
        weight = module.weight
        out_features, in_features = weight.shape
        module.__class__ = _lora_class(type(module))
        module.lora_scale = config.alpha / config.rank
        module.lora_a = _new_parameter(weight, (config.rank, in_features), "lora_a")
        module.lora_b = _new_parameter(weight, (out_features, config.rank), "lora_b")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))
    return model


def check_added(part: nn.Module, config: LoRA, family: str) -> None:
    """Refuse a parallelized model part whose targeted layers got no adapters: its family's
    ``parallelize`` does not call :func:`add_adapters` (every weight would train); and a
    pipeline stage with no adapter at all (nothing to optimize, checkpoint or clip there)."""
    if config.rank <= 0:
        return
    for name, module in part.named_modules():
        if isinstance(module, nn.Linear) and not is_adapted(module):
            if _targeted(clean_name(name), config.targets()):
                raise ConfigError(
                    f"--lora.rank: model {family}'s parallelize adds no LoRA adapters (e.g. to "
                    f"{clean_name(name)}); it must call components.lora.add_adapters(model, "
                    "context.lora) after its tensor-parallel plan (docs/extending.md)"
                )
    if not any(is_adapted(m) for m in part.modules()):
        held = [
            f"{name}.{key}" if isinstance(child, nn.ModuleDict) else name
            for name, child in part.named_children()
            if child is not None
            for key in (child.keys() if isinstance(child, nn.ModuleDict) else [None])
        ]
        raise ConfigError(
            f"--lora.target_modules {' '.join(config.targets()) or '(default)'}: the pipeline "
            f"stage of {', '.join(held)} has no layer to adapt, so nothing to train (its "
            "optimizer could not be stepped or saved); target a layer it holds, or give it a "
            "block with --parallelism.pipeline_parallel_layers_per_stage or "
            "--parallelism.module_fqns_per_model_part"
        )


@torch.no_grad()
def init_adapters(model: nn.Module) -> None:
    """``A`` as a linear layer's default initialisation, ``B`` zero (the adapted model starts
    as the frozen one). Call it after the model's own ``init_weights``, seeded."""
    for module in model.modules():
        if is_adapted(module):
            nn.init.kaiming_uniform_(module.lora_a, a=math.sqrt(5))
            nn.init.zeros_(module.lora_b)


def scale_of(config: LoRA | dict[str, Any] | None) -> float | None:
    """``alpha / rank`` of a LoRA config (or its TOML section); ``None`` where LoRA is off."""
    if config is None:
        return None
    rank, alpha = (
        (config.get("rank", 0), config.get("alpha", LoRA.alpha))
        if isinstance(config, dict)
        else (config.rank, config.alpha)
    )
    return alpha / rank if rank > 0 else None


def merged_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """``W + scale B A`` (full tensors), computed and returned in float32 (or ``W``'s wider
    dtype): the weight of a plain linear layer that computes what the adapted one does. Not
    rounded back to a bf16 ``W`` (``--training.dtype bfloat16``): an update of 1e-3 of the
    weight is under bf16's spacing; exports cast to their own dtype."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    return weight.to(dtype) + scale * (lora_b.to(dtype) @ lora_a.to(dtype))


def merge_state_dict(
    state: dict[str, torch.Tensor], scale: float | None
) -> dict[str, torch.Tensor]:
    """A full state dict with every adapter folded into its layer's weight (and removed): the
    state of the plain model. ``scale``: the run's ``alpha / rank``; ``None`` with adapters in
    ``state`` is an error."""
    prefixes = sorted({k.rsplit(".", 1)[0] for k in state if is_adapter_name(k)})
    if not prefixes:
        return state
    if scale is None:
        raise ConfigError(
            f"the checkpoint has LoRA adapters ({prefixes[0]}.lora_a) but its config has no "
            "[lora] rank: cannot merge them"
        )
    merged = {k: v for k, v in state.items() if not is_adapter_name(k)}
    for prefix in prefixes:
        merged[f"{prefix}.weight"] = merged_weight(
            state[f"{prefix}.weight"], state[f"{prefix}.lora_a"], state[f"{prefix}.lora_b"], scale
        )
    return merged


def frozen_names(model_parts: Iterable[nn.Module]) -> set[str]:
    """The state-dict names of the frozen parameters of ``model_parts``."""
    return {
        clean_name(name)
        for part in model_parts
        # a tied output projection is the embedding table under a second name
        for name, param in part.named_parameters(remove_duplicate=False)
        if not param.requires_grad
    }


def adapter_count(parameters: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Elements of the adapters among named parameters (global shapes)."""
    return sum(p.numel() for n, p in parameters if is_adapter_name(n))


def flops_per_token(full: float, weights: float, adapters: int) -> float:
    """Training FLOPs per token with frozen weights: ``full`` (the model's count, 6 per weight
    plus attention) less the weight gradients of the frozen weights (2 of their 6, ``weights``
    being the weights' share of ``full``), plus 6 per adapter element."""
    return full - weights / 3 + 6 * adapters

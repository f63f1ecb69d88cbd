"""The model contract: what the trainer, the config pre-flight and the dry run know of a model.

A model family is a Python package (``torchtitan.models.<name>`` or any importable module
path) with a module-level ``model_spec = ModelSpec(...)``. Importing the package must not
import torch: the config pre-flight reads ``flavors``, ``config_registry`` and ``validate``
before any rank starts, in well under a second. The torch parts (``build_model``,
``parallelize``) are named by import path with :func:`lazy` and loaded when a run builds the
model. Nothing in the core changes to add a family; ``docs/extending.md`` walks through one.
"""

import dataclasses
import importlib
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import (
    ActivationCheckpoint,
    Compile,
    Float8,
    JobConfig,
    LoRA,
    Parallelism,
    Training,
)
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.moe_args import with_training

if TYPE_CHECKING:
    from torch import nn


class ModelArgs(Protocol):
    """What the core reads of a flavor (a frozen dataclass; the trainer replaces
    ``max_seq_len`` with ``--training.seq_len``)."""

    vocab_size: int
    n_layers: int
    """Identical blocks; the dry run's memory estimate extrapolates over them."""
    max_seq_len: int


@dataclasses.dataclass(frozen=True)
class ParallelizeContext:
    """Everything model-independent that a ``parallelize`` function may use, built once per run.

    Meshes come from ``parallel_dims.mesh(name)`` once ``parallel_dims.meshes_built`` (every
    run with more than one rank); a one-process run has none. A new technique adds its config
    section here, not a keyword at every call site.
    """

    parallel_dims: ParallelDims
    attn_mask: str
    """``--model.attn_mask``: ``causal`` or ``block_causal`` (context parallelism differs)."""
    training: Training
    parallelism: Parallelism
    activation_checkpoint: ActivationCheckpoint
    compile: Compile
    float8: Float8
    lora: LoRA
    """``--lora.*``: ``parallelize`` adds the adapters (``components.lora.add_adapters``) after
    tensor, context and expert parallelism, before activation checkpointing."""

    @classmethod
    def from_config(cls, config: JobConfig, parallel_dims: ParallelDims) -> "ParallelizeContext":
        return cls(
            parallel_dims=parallel_dims,
            attn_mask=config.model.attn_mask,
            training=config.training,
            parallelism=config.parallelism,
            activation_checkpoint=config.activation_checkpoint,
            compile=config.compile,
            float8=config.float8,
            lora=config.lora,
        )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model family: how to build it, parallelize it, check a config against it.

    The built module must provide ``init_weights(buffer_device=...)`` (called under
    ``torch.no_grad`` after the meta-device model is materialised, seeded with
    ``--debug.seed``) and ``forward(tokens [bs, seq]) -> logits [bs, seq, vocab]``.
    """

    name: str
    flavors: Mapping[str, ModelArgs]
    """Flavor name -> args (``--model.flavor``)."""
    config_registry: types.ModuleType
    """A module of functions, each returning a full ``JobConfig`` (``--config NAME``)."""
    build_model: Callable[[Any], "nn.Module"]
    """``build_model(args) -> nn.Module``; called under the meta device."""
    parallelize: Callable[["nn.Module", ParallelizeContext], "nn.Module"]
    """``parallelize(model_part, context) -> model_part``, applied to every model part: the
    plans (TP, activation checkpointing, compile, data parallel) in that order."""
    flops_per_token: Callable[[Any, int], float]
    """``flops_per_token(args, seq_len)``: training FLOPs (forward + backward) per token, from
    the parameters a token activates (for MoE: the routed experts only), for TFLOPs and MFU."""
    validate: Callable[[JobConfig, ParallelDims], None] | None = None
    """Torch-free checks of a config against the model's dims (e.g. heads divisible by TP),
    raising ``ConfigError``; run by the pre-flight before any rank starts."""
    pipeline: Callable[[Any, int, Parallelism], list[list[str]]] | None = None
    """``pipeline(args, num_stages, parallelism)``: the module names of each pipeline stage, in
    model order (torch-free: the pre-flight checks it). The model's top-level modules not named
    are removed from a stage (set to ``None``: its ``forward`` must skip them), and so are the
    entries of a ``ModuleDict`` of blocks. ``None``: the family cannot be pipelined."""
    forward_keywords: tuple[str, ...] = ()
    """Keyword inputs ``forward`` takes besides the tokens, each ``[bs, seq]``:
    ``positions`` (each token's place in its sequence, for RoPE: context parallelism needs it,
    with a ``parallelize`` that hooks the attention products by
    ``distributed.context_parallel.apply_cp``) and ``document_ids`` (each token's document in
    its window: block-causal attention needs it; under context parallelism they cover the whole
    window while the tokens and positions are the rank's share, and ``forward`` passes both to
    ``models.common.attention.attention_documents``)."""
    state_dict_adapter: Callable[..., Any] | None = None
    """``state_dict_adapter(args)``: converts tensors to and from the Hugging Face layout
    (``models/llama3/state_dict_adapter.py``); ``None``: no HF import or export."""
    has_experts: bool = False
    """Mixture-of-experts layers in some flavors: those whose args' ``moe`` field
    (``models.common.moe_args.MoEArgs``) is set (:meth:`flavor_has_experts`); for them
    ``--parallelism.expert_parallel_degree``, ``--moe.*`` and ``after_optimizer_step`` apply."""
    after_optimizer_step: Callable[..., dict[str, float]] | None = None
    """``after_optimizer_step(model_parts, group, pp_group, *, report)``, called by the
    trainer after every optimizer step with the process group of the ranks that see different
    tokens and that of the pipeline stages (each ``None`` where there is one); returns metrics
    to log (e.g. MoE expert-bias updates and loads) when ``report`` (a logging step), else
    ``{}`` without reading values on the host."""

    def flavor_has_experts(self, flavor: str) -> bool:
        """Whether ``flavor`` has mixture-of-experts layers."""
        args = self.flavors.get(flavor)
        return self.has_experts and getattr(args, "moe", None) is not None

    def after_optimizer_step_for(self, flavor: str) -> Callable[..., dict[str, float]] | None:
        """``after_optimizer_step`` for a run of ``flavor`` (in a family with experts, only
        its flavors with experts have the work it does)."""
        if self.has_experts and not self.flavor_has_experts(flavor):
            return None
        return self.after_optimizer_step

    def args_for(self, flavor: str, *, seq_len: int, config: JobConfig | None = None) -> Any:
        """The flavor's args with the RoPE/position table sized for ``seq_len`` and, for a
        flavor with experts, the run's ``--moe.*`` settings."""
        args = dataclasses.replace(self.flavors[flavor], max_seq_len=seq_len)
        if self.flavor_has_experts(flavor) and config is not None:
            args = dataclasses.replace(args, moe=with_training(args.moe, config.moe))
        return args


@dataclasses.dataclass(frozen=True)
class lazy:  # noqa: N801 (reads as a function at the call site)
    """A callable named by ``"package.module:attribute"``, imported on its first call.

    Lets a model package describe its torch parts without importing torch itself.
    """

    target: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def resolve(self) -> Any:
        """The named object itself (importing its module)."""
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)


def import_model_module(name: str) -> types.ModuleType:
    """Import a model package from a short name (``llama3``) or a module path (``my.models.x``)."""
    candidates = [name] if "." in name else [f"torchtitan.models.{name}", name]
    for candidate in candidates:
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            # Only swallow "this candidate does not exist", never an import error inside it.
            missing = e.name or ""
            if not (candidate == missing or candidate.startswith(missing + ".")):
                raise
    raise ConfigError(
        f"model module {name!r} not found: tried {', '.join(candidates)}; pass --module / "
        "--model.name as a name under torchtitan.models or an importable module path"
    )


def get_model_spec(name: str) -> ModelSpec:
    """The ``model_spec`` of a model package (see the module docstring)."""
    module = import_model_module(name)
    spec = vars(module).get("model_spec")
    if not isinstance(spec, ModelSpec):
        raise ConfigError(
            f"model module {module.__name__} has no model_spec: define "
            "model_spec = ModelSpec(...) in it (torchtitan.models.spec; see docs/extending.md)"
        )
    return spec

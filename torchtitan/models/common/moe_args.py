"""Shapes and routing rules of a mixture-of-experts layer (part of a model flavor). No torch
import here: flavors are read by the config pre-flight."""

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class MoEArgs:
    num_experts: int = 8
    """Routed experts per MoE layer."""
    num_shared_experts: int = 1
    """Experts every token goes through (one SwiGLU of ``num_shared_experts x hidden``)."""
    top_k: int = 2
    """Routed experts per token."""
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    """Affinity of a token to each expert from the router's logits."""
    route_norm: bool = True
    """Rescale a token's top-k scores to sum to 1 (before ``route_scale``)."""
    route_scale: float = 1.0
    """Multiplies the routed experts' weights."""
    num_groups: int = 1
    """Group-limited routing: experts fall into this many groups, and a token picks its experts
    only from its ``top_groups`` best groups (a group's score: the sum of its two best experts'
    selection scores). 1 turns it off."""
    top_groups: int = 1
    """Groups a token may route to (with ``num_groups > 1``)."""
    # Training-time settings, from ``--moe.*`` (``models.common.moe_args.with_training``).
    load_balance_coeff: float = 1e-3
    aux_loss_coeff: float = 0.0
    capacity_factor: float = 0.0
    experts_impl: Literal["auto", "grouped_mm", "loop"] = "auto"


def with_training(args: MoEArgs, moe_config) -> MoEArgs:
    """``args`` with the ``--moe.*`` settings of the run."""
    return dataclasses.replace(
        args,
        load_balance_coeff=moe_config.load_balance_coeff,
        aux_loss_coeff=moe_config.aux_loss_coeff,
        capacity_factor=moe_config.capacity_factor,
        experts_impl=moe_config.experts_impl,
    )

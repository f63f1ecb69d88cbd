"""Shapes and routing rules of a mixture-of-experts layer (part of a model flavor). No torch
import here: flavors are read by the config pre-flight."""

import dataclasses
from typing import Literal

from torchtitan.config.errors import ConfigError


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
    router_bias: bool = False
    """The router's linear layer has a bias (gpt-oss)."""
    expert_linear_bias: bool = False
    """Each routed expert's three projections have biases (gpt-oss's ``w1_bias``, ``w3_bias``
    ``[E, hidden]`` and ``w2_bias [E, dim]``; unrelated to the balancing ``expert_bias``)."""
    activation: Literal["silu", "clamped_swiglu"] = "silu"
    """The routed experts' gating of ``gate = x W1`` and ``up = x W3``: ``silu`` is SwiGLU,
    ``silu(gate) * up``; ``clamped_swiglu`` is gpt-oss's: ``gate`` clamped above and ``up``
    both ways at ``swiglu_limit``, then ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``."""
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    score_before_experts: bool = False
    """Scale each routed row by its weight before its expert instead of the expert's output
    after (Llama 4; the same for experts that are linear in their input, not for SwiGLU)."""
    # Training-time settings, from ``--moe.*`` (``models.common.moe_args.with_training``).
    load_balance_coeff: float = 1e-3
    aux_loss_coeff: float = 0.0
    capacity_factor: float = 0.0
    experts_impl: Literal["auto", "grouped_mm", "loop"] = "auto"
    force_load_balance: bool = False


def with_training(args: MoEArgs, moe_config) -> MoEArgs:
    """``args`` with the ``--moe.*`` settings of the run."""
    return dataclasses.replace(
        args,
        load_balance_coeff=moe_config.load_balance_coeff,
        aux_loss_coeff=moe_config.aux_loss_coeff,
        capacity_factor=moe_config.capacity_factor,
        experts_impl=moe_config.experts_impl,
        force_load_balance=moe_config.force_load_balance,
    )


def check_moe_degrees(args: MoEArgs, hidden: int, *, flavor: str, tp: int, ep: int) -> None:
    """Reject tensor- and expert-parallel degrees that cannot split a flavor's experts of
    hidden width ``hidden`` evenly (one line, ``ConfigError``)."""
    flag = f"--parallelism.tensor_parallel_degree={tp}"
    widths = {"the shared experts' hidden size": hidden * args.num_shared_experts}
    if ep == 1:  # else expert parallelism splits the routed experts, whole
        widths["the routed experts' hidden size"] = hidden
    for name, value in widths.items():
        if value and value % tp:
            raise ConfigError(f"{flag} does not divide {name}={value} of flavor {flavor}")
    if args.num_experts % ep:
        raise ConfigError(
            f"--parallelism.expert_parallel_degree={ep} does not divide num_experts="
            f"{args.num_experts} of flavor {flavor}: each expert-parallel rank holds "
            "num_experts / ep experts"
        )


def check_moe_run(config, parallel_dims, family: str) -> None:
    """The ``--moe.*`` settings and parallel degrees a run with experts must respect (one
    line, ``ConfigError``); ``config`` a ``JobConfig``, ``parallel_dims`` its degrees."""
    moe = config.moe
    if config.comm.mode == "local_tensor":  # simulated ranks route differently
        why = "under COMM_MODE=local_tensor"
        if moe.experts_impl == "loop":
            raise ConfigError(
                f"--moe.experts_impl loop {why} is not implemented for {family} yet: each "
                "rank's rows per expert differ; use grouped_mm or auto"
            )
        if moe.capacity_factor > 0:
            raise ConfigError(
                f"--moe.capacity_factor > 0 {why} is not implemented for {family} yet: each "
                "rank drops a different number of routings"
            )
    if parallel_dims.ep > 1 and parallel_dims.tp > 1:
        if not config.parallelism.enable_sequence_parallel:
            raise ConfigError(
                "--parallelism.no_enable_sequence_parallel with expert and tensor parallelism: "
                "experts span the TP ranks, each routing its own sequence shard; keep sequence "
                "parallelism on, or use --parallelism.expert_parallel_degree 1"
            )
    if moe.capacity_factor < 0 or moe.aux_loss_coeff < 0:
        raise ConfigError("--moe.capacity_factor and --moe.aux_loss_coeff must be >= 0")


def check_hf_export_balancing(config, architecture: str) -> None:
    """An HF export of a family whose HF model has no routing bias must not learn one (one
    line, ``ConfigError``); ``config`` a ``JobConfig``."""
    if config.checkpoint.last_save_in_hf and config.moe.load_balance_coeff > 0:
        raise ConfigError(
            "--checkpoint.last_save_in_hf with --moe.load_balance_coeff > 0: the routing bias it "
            f"learns has no place in {architecture} (the export would route differently); pass "
            "--moe.load_balance_coeff 0 (--moe.aux_loss_coeff balances)"
        )

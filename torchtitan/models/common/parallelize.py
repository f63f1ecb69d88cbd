"""The parts of a decoder's parallelization that do not depend on its attention: the
mixture-of-experts layer's plans (tensor, context and expert parallelism), torch.compile of
blocks with routed experts, and data parallelism (FSDP, with the experts sharded on their own
mesh under expert parallelism). Each family's ``parallelize.py`` calls them in its order
(``models/llama3/parallelize.py`` explains the order).

A block with experts has ``moe_enabled`` and a ``moe`` (``models.common.moe.MoE``); a dense one
a ``feed_forward``. Blocks are the values of ``model.layers``.
"""

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, SequenceParallel

from torchtitan.distributed import precision
from torchtitan.distributed.compile import (
    apply_compile,
    apply_compile_around,
    graphs_hold_collectives,
)
from torchtitan.distributed.expert_parallel import apply_ep
from torchtitan.distributed.fsdp import (
    apply_fsdp,
    apply_fsdp_experts,
    apply_replicate,
    mixed_precision_policy,
)
from torchtitan.distributed.simple_fsdp import apply_simple_fsdp, apply_simple_fsdp_over
from torchtitan.distributed.tensor_parallel import (
    GatherInputReduceOutput,
    PartialRowwiseParallel,
    ReplicatedInputPartialGradient,
    ShardParameters,
)
from torchtitan.models.common.experts import GroupedExperts
from torchtitan.models.common.moe import MoE
from torchtitan.models.spec import ParallelizeContext
from torchtitan.tools.logging import logger


def routed_experts(model: nn.Module) -> list[GroupedExperts]:
    """The routed experts of every block with experts (before any wrapper)."""
    return [b.moe.experts for b in model.layers.values() if b.moe_enabled]


def moe_tp_plan(block: nn.Module, tp_mesh: DeviceMesh, *, between: Placement, split_tokens: bool):
    """The tensor-parallel plan of ``block.moe`` (entries named from the block).

    Without ``split_tokens`` every TP rank routes the whole tokens (gathered from the sequence
    shards under SP) with the replicated router, and every expert's hidden width is split over
    the ranks, routed (``w1``/``w3`` along their rows, ``w2`` along its columns) and shared
    (column- then row-parallel) alike, with their biases (the output's whole on every rank,
    counted once): each rank computes a partial sum of the layer's output,
    reduced once after it (reduce-scattered back to the sequence shards under SP, all-reduced
    without). With ``split_tokens`` (expert parallelism spans the TP ranks; needs sequence
    parallelism) each TP rank routes its own sequence shard: the router's gate and the shared
    experts are replicated weights on sharded tokens (torch's ``SequenceParallel``, gradients
    summed over the ranks), the routed experts are split by expert parallelism.
    """
    moe = block.moe
    plan = {}
    if split_tokens:
        plan["moe"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        plan["moe.router.gate"] = SequenceParallel(sequence_dim=0, use_local_output=True)
        if moe.shared_experts is not None:  # (the style takes leaf modules only)
            for name in ("w1", "w2", "w3"):
                plan[f"moe.shared_experts.{name}"] = SequenceParallel(
                    sequence_dim=0, use_local_output=True
                )
        moe.token_split_mesh = tp_mesh
        return plan
    # The layer runs on the whole tokens as a plain tensor and returns this rank's partial
    # sum of its output, reduced to the residual stream's layout after it.
    plan["moe"] = GatherInputReduceOutput(between)
    split = {"w1": 1, "w2": 2, "w3": 1}
    if moe.experts.has_bias:  # w2's bias stays whole: added once over the partial sums
        split |= {"w1_bias": 1, "w3_bias": 1}
        moe.experts.partial_output_mesh = tp_mesh
    plan["moe.experts"] = ShardParameters(split)
    moe.hidden_split_mesh = tp_mesh
    if moe.shared_experts is not None:
        # Its input's gradient joins the layer's partial sum.
        plan["moe.shared_experts"] = ReplicatedInputPartialGradient()
        plan["moe.shared_experts.w1"] = ColwiseParallel()
        plan["moe.shared_experts.w2"] = PartialRowwiseParallel()
        plan["moe.shared_experts.w3"] = ColwiseParallel()
    return plan


def apply_moe_cp_and_ep(model: nn.Module, context: ParallelizeContext) -> None:
    """After tensor and context parallelism: the balance loss of a block with experts sums over
    the CP shards of its sequences; expert parallelism splits the routed experts over the
    ``ep`` mesh (before anything wraps the blocks)."""
    dims = context.parallel_dims
    if dims.cp_enabled:
        for block in model.layers.values():
            if block.moe_enabled:
                block.moe.context_parallel_mesh = dims.mesh("cp")
    if dims.ep_enabled:
        apply_ep(routed_experts(model), dims.mesh("ep"), data_parallel_ranks=dims.ep_data_parallel)


def compile_blocks(model: nn.Module, context: ParallelizeContext) -> None:
    """``--compile.enable`` with ``model`` in its components: every block compiled (under
    ``--activation_checkpoint.memory_budget`` in that mode). Routing has
    data-dependent shapes (rows per expert, the EP exchange): blocks with experts compile their
    attention, norms, router and shared experts; the routed experts and the dispatch between
    them run eager."""
    compile, dims = context.compile, context.parallel_dims
    if not (compile.enable and "model" in compile.components):
        return
    tp, collectives = dims.tp_enabled, graphs_hold_collectives(dims, context.parallelism)
    ac = context.activation_checkpoint
    budget = ac.memory_budget if ac.mode == "memory_budget" else None
    dense = nn.ModuleDict({n: b for n, b in model.layers.items() if not _has_experts(b)})
    apply_compile(dense, compile, tensor_parallel=tp, collectives=collectives, memory_budget=budget)
    for name, block in model.layers.items():
        if name in dense:
            model.layers[name] = dense[name]
        else:
            apply_compile_around(
                block, compile, eager=_moe_or_experts, tensor_parallel=tp,
                collectives=collectives, memory_budget=budget,
            )  # fmt: skip


def apply_data_parallel(
    model: nn.Module, context: ParallelizeContext, experts: list[GroupedExperts]
) -> nn.Module:
    """FSDP over dp_shard x cp (each block a unit, the routed ``experts`` units of their own:
    under EP sharded over the data-parallel ranks EP leaves, ``efsdp``), HSDP, simple FSDP, or
    replication; nothing in a one-process run."""
    dims, parallelism, training = context.parallel_dims, context.parallelism, context.training
    if training.enable_cpu_offload:
        _say_where_offload_moves_nothing(dims)
    if not dims.meshes_built:
        return model
    mp_policy = mixed_precision_policy(
        precision.compute_dtype(training), training.mixed_precision_reduce
    )
    hsdp = dims.replicas_reduce_gradients
    efsdp_mesh = None
    if dims.ep_enabled:
        efsdp_mesh = dims.mesh("dp_replicate", "efsdp") if hsdp else dims.mesh("efsdp")
    if parallelism.fsdp_impl == "simple" and (dims.fsdp_enabled or hsdp):
        if efsdp_mesh is not None:  # experts: sharded over efsdp, on top of EP's split
            for module in experts:
                apply_simple_fsdp(
                    module,
                    dp_mesh=efsdp_mesh,
                    tp_mesh=dims.mesh("ep"),
                    param_dtype=mp_policy.param_dtype,
                    reduce_dtype=mp_policy.reduce_dtype,
                )
        return apply_simple_fsdp_over(model, dims, mp_policy)
    if not dims.fsdp_enabled:
        if hsdp:  # replicated: experts like every other parameter
            return apply_replicate(
                model, model.layers.values(), dims.mesh("dp_replicate"), mp_policy=mp_policy
            )
        return model
    reshard = parallelism.fsdp_reshard_after_forward
    if experts:
        apply_fsdp_experts(
            experts,
            efsdp_mesh if efsdp_mesh is not None else dims.data_parallel_mesh(),
            mp_policy=mp_policy,
            reshard_after_forward=reshard,
            cpu_offload=training.enable_cpu_offload,
        )
    return apply_fsdp(
        model,
        model.layers.values(),
        dims.data_parallel_mesh(),
        mp_policy=mp_policy,
        reshard_after_forward=reshard,
        cpu_offload=training.enable_cpu_offload,
        prefetch=parallelism.fsdp_prefetch,
        inner_units=(
            [[b.moe.experts] if b.moe_enabled else [] for b in _inner_blocks(model)]
            if experts
            else ()
        ),
    )


def _moe_or_experts(module: nn.Module) -> bool:
    return isinstance(module, (MoE, GroupedExperts))


def _has_experts(block: nn.Module) -> bool:
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    return inner.moe_enabled


def _inner_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks under any activation checkpointing or compile wrapper."""
    blocks = []
    for block in model.layers.values():
        block = getattr(block, "_orig_mod", block)
        blocks.append(getattr(block, "_checkpoint_wrapped_module", block))
    return blocks


def _say_where_offload_moves_nothing(dims) -> None:
    """``--training.enable_cpu_offload`` offloads what FSDP shards, to host memory: one line
    where that is nothing, rather than silence."""
    if not dims.fsdp_enabled:
        logger.warning(
            "--training.enable_cpu_offload is ignored: it offloads FSDP-sharded state, and "
            "this run shards nothing (--parallelism.data_parallel_shard_degree 1, no CP)"
        )
    elif dist.is_initialized() and dist.get_backend() == "gloo":
        logger.info(
            "--training.enable_cpu_offload on CPU: parameters, gradients and optimizer state "
            "already live in host memory, so it moves nothing"
        )

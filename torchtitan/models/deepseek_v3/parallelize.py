"""How DeepSeek-V3 is parallelized: which modules each technique wraps. Plans only.

Order: float8 (linear layers; the routed experts stay in high precision) -> tensor parallel ->
context parallel -> expert parallel -> activation checkpointing -> torch.compile -> data parallel
(FSDP), for Llama 3's reasons (``models/llama3/parallelize.py``);
expert parallelism shards the routed experts' weights before anything wraps the blocks, and FSDP
shards the experts over the data-parallel ranks EP leaves (``efsdp``) before their blocks.
"""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.components.float8 import apply_float8, scalar_cpu_kernels
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import (
    apply_compile,
    apply_compile_around,
    graphs_hold_collectives,
)
from torchtitan.distributed.context_parallel import apply_cp
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
    SumGradients,
    apply_tp_embedding_and_output,
    enable_async_tp,
)
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.models.spec import ParallelizeContext


def parallelize_deepseek_v3(model: nn.Module, context: ParallelizeContext) -> nn.Module:
    """Apply every technique ``context`` asks for to ``model`` (one model part)."""
    dims, parallelism = context.parallel_dims, context.parallelism
    experts = [b.moe.experts for b in model.layers.values() if b.moe_enabled]
    if context.float8.enable:  # first: the parallel plans then wrap float8 linears
        casts = dims.fsdp_enabled or dims.dp_replicate_enabled  # else bf16 comes by autocast
        bf16 = context.training.mixed_precision_param != "float32"
        apply_float8(model, context.float8, autocast=bf16 and not casts)
        if bf16 and context.compile.enable and "model" in context.compile.components:
            scalar_cpu_kernels()
    if dims.tp_enabled:
        apply_tp(
            model,
            dims.mesh("tp"),
            loss_parallel=not parallelism.disable_loss_parallel,
            sequence_parallel=parallelism.enable_sequence_parallel,
            split_tokens=dims.ep_enabled,
        )
        if parallelism.enable_async_tensor_parallel:
            enable_async_tp(dims.mesh("tp"))
    if dims.cp_enabled:
        cp_mesh = dims.mesh("cp")
        apply_cp(
            [block.attention.sdpa for block in model.layers.values()],
            cp_mesh,
            rotate_method=parallelism.context_parallel_rotate_method,
            load_balance=parallelism.context_parallel_load_balance,
            block_causal=context.attn_mask == "block_causal",
        )
        for block in model.layers.values():
            if block.moe_enabled:  # its sequence-wise balance loss sums over the CP shards
                block.moe.context_parallel_mesh = cp_mesh
    if dims.ep_enabled:
        apply_ep(experts, dims.mesh("ep"), data_parallel_ranks=dims.ep_data_parallel)
    apply_ac(model.layers, context.activation_checkpoint)
    if context.compile.enable and "model" in context.compile.components:
        tp, collectives = dims.tp_enabled, graphs_hold_collectives(dims, parallelism)
        # Routing has data-dependent shapes (rows per expert, the EP exchange): MoE blocks
        # compile their attention, norms, router and shared experts; the routed experts and
        # the dispatch between them run eager.
        dense = nn.ModuleDict({n: b for n, b in model.layers.items() if not _is_moe(b)})
        apply_compile(dense, context.compile, tensor_parallel=tp, collectives=collectives)
        for name, block in model.layers.items():
            if name in dense:
                model.layers[name] = dense[name]
            else:
                apply_compile_around(
                    block,
                    context.compile,
                    eager=_moe_or_experts,
                    tensor_parallel=tp,
                    collectives=collectives,
                )
    if not dims.meshes_built:
        return model
    training = context.training
    mp_policy = mixed_precision_policy(
        training.mixed_precision_param, training.mixed_precision_reduce
    )
    hsdp = dims.dp_replicate_enabled
    # Under EP, FSDP shards the experts over the data-parallel ranks EP leaves.
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
        if dims.dp_replicate_enabled:  # replicated: experts like every other parameter
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
        inner_units=[[b.moe.experts] if b.moe_enabled else [] for b in _inner_blocks(model)],
    )


def _moe_or_experts(module: nn.Module) -> bool:
    return isinstance(module, (MoE, GroupedExperts))


def _is_moe(block: nn.Module) -> bool:
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    return inner.moe_enabled


def _inner_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks under any activation checkpointing or compile wrapper."""
    blocks = []
    for block in model.layers.values():
        block = getattr(block, "_orig_mod", block)
        blocks.append(getattr(block, "_checkpoint_wrapped_module", block))
    return blocks


def apply_tp(
    model: nn.Module,
    tp_mesh,
    *,
    loss_parallel: bool,
    sequence_parallel: bool,
    split_tokens: bool = False,
) -> None:
    """Megatron-style TP on attention heads, dense FFNs and shared experts.

    The latent projections (``wkv_a``, ``kv_norm``, and ``wq_a``, ``q_norm``) are small and
    stay whole on every rank; ``wq``/``wq_b`` and ``wkv_b`` are column-parallel (each rank
    computes its heads), ``wo`` row-parallel; the keys' shared RoPE part has its gradient
    summed over the ranks (each uses it for its own heads only).

    Mixture-of-experts layers: without ``split_tokens`` every TP rank routes the whole tokens
    (gathered from the sequence shards under SP) with the replicated router, and every
    expert's hidden width is split over the ranks, routed (``w1``/``w3`` along their rows,
    ``w2`` along its columns) and shared (column- then row-parallel) alike: each rank computes
    a partial sum of the layer's output, reduced once after it (reduce-scattered back to the
    sequence shards under SP, all-reduced without). With ``split_tokens`` (expert parallelism
    spans the TP ranks; needs sequence parallelism) each TP rank routes its own sequence
    shard: the router's gate and the shared experts are replicated weights on sharded tokens
    (torch's ``SequenceParallel``, gradients summed over the ranks), the routed experts are
    split by expert parallelism.
    """
    between = Shard(1) if sequence_parallel else Replicate()
    apply_tp_embedding_and_output(
        model, tp_mesh, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel
    )

    for block in model.layers.values():
        attention = block.attention
        plan = {
            # Plain replicated tensors inside attention: the whole-input latent projections
            # run as ordinary modules; the column-parallel ones take them as Replicate.
            "attention": PrepareModuleInput(
                input_layouts=(between, None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
            "attention.wkv_b": ColwiseParallel(),
            # Each rank's heads use all of the shared RoPE key: sum its gradient.
            "attention.shared_key": SumGradients(),
            "attention.wo": RowwiseParallel(output_layouts=between),
        }
        if attention.wq is not None:
            plan["attention.wq"] = ColwiseParallel()
        else:
            plan["attention.wq_b"] = ColwiseParallel()
        if block.moe_enabled and split_tokens:
            plan["moe"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
            plan["moe.router.gate"] = SequenceParallel(sequence_dim=0, use_local_output=True)
            if block.moe.shared_experts is not None:  # (the style takes leaf modules only)
                for name in ("w1", "w2", "w3"):
                    plan[f"moe.shared_experts.{name}"] = SequenceParallel(
                        sequence_dim=0, use_local_output=True
                    )
            block.moe.token_split_mesh = tp_mesh
        elif block.moe_enabled:
            # The layer runs on the whole tokens as a plain tensor and returns this rank's
            # partial sum of its output, reduced to the residual stream's layout after it.
            plan["moe"] = GatherInputReduceOutput(between)
            plan["moe.experts"] = ShardParameters({"w1": 1, "w2": 2, "w3": 1})
            block.moe.hidden_split_mesh = tp_mesh
            if block.moe.shared_experts is not None:
                # Its input's gradient joins the layer's partial sum.
                plan["moe.shared_experts"] = ReplicatedInputPartialGradient()
                plan["moe.shared_experts.w1"] = ColwiseParallel()
                plan["moe.shared_experts.w2"] = PartialRowwiseParallel()
                plan["moe.shared_experts.w3"] = ColwiseParallel()
        else:
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(between,), desired_input_layouts=(Replicate(),)
            )
            plan["feed_forward.w1"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=between)
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)

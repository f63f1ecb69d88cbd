"""How Llama 3 is parallelized: which modules each technique wraps. Plans only, no machinery.

Order: float8 -> tensor parallel -> context parallel -> activation checkpointing -> torch.compile
-> data parallel (FSDP). float8 swaps linear modules, so it comes before anything wraps them. TP
then because it rewrites parameters into DTensors that the later wrappers
must see; CP hooks the attention product inside the block, before anything wraps the block; AC
wraps the TP'd block so recomputation replays its collectives (the CP ring included); compile
traces the block with its checkpointing; FSDP last so it shards (and gathers) the final
parameters of each unit, over dp_shard x cp.
"""

import functools

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.components import float8
from torchtitan.components.float8 import tp_style
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile, graphs_hold_collectives
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.fsdp import apply_fsdp, apply_replicate, mixed_precision_policy
from torchtitan.distributed.simple_fsdp import apply_simple_fsdp_over
from torchtitan.distributed.tensor_parallel import apply_tp_embedding_and_output, enable_async_tp
from torchtitan.models.spec import ParallelizeContext


def parallelize_llama3(model: nn.Module, context: ParallelizeContext) -> nn.Module:
    """Apply every technique ``context`` asks for to ``model`` (one model part)."""
    dims, parallelism, compile = context.parallel_dims, context.parallelism, context.compile
    if context.float8.enable:  # first: the parallel plans then wrap float8 linears
        casts = dims.fsdp_enabled or dims.dp_replicate_enabled  # else bf16 comes by autocast
        bf16 = context.training.mixed_precision_param != "float32"
        float8.apply_float8(model, context.float8, autocast=bf16 and not casts)
        if bf16 and compile.enable and "model" in compile.components:
            float8.scalar_cpu_kernels()
    if dims.tp_enabled:
        tp_mesh = dims.mesh("tp")
        sequence_parallel = parallelism.enable_sequence_parallel
        apply_tp(
            model,
            tp_mesh,
            loss_parallel=not parallelism.disable_loss_parallel,
            sequence_parallel=sequence_parallel,
            float8_styles=float8.tp_in_float8(
                context.float8, tp_mesh, sequence_parallel=sequence_parallel
            ),
        )
        if parallelism.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)
    if dims.cp_enabled:
        apply_cp(
            [block.attention.sdpa for block in model.layers.values()],
            dims.mesh("cp"),
            rotate_method=parallelism.context_parallel_rotate_method,
            load_balance=parallelism.context_parallel_load_balance,
            block_causal=context.attn_mask == "block_causal",
        )
    apply_ac(model.layers, context.activation_checkpoint)
    if compile.enable and "model" in compile.components:
        apply_compile(
            model.layers,
            compile,
            tensor_parallel=dims.tp_enabled,
            collectives=graphs_hold_collectives(dims, parallelism),
        )
    if not dims.meshes_built:
        return model
    training = context.training
    mp_policy = mixed_precision_policy(
        training.mixed_precision_param, training.mixed_precision_reduce
    )
    blocks = model.layers.values()
    if parallelism.fsdp_impl == "simple" and (dims.fsdp_enabled or dims.dp_replicate_enabled):
        return apply_simple_fsdp_over(model, dims, mp_policy)
    if dims.fsdp_enabled:
        return apply_fsdp(
            model,
            blocks,
            dims.data_parallel_mesh(),
            mp_policy=mp_policy,
            reshard_after_forward=parallelism.fsdp_reshard_after_forward,
            cpu_offload=training.enable_cpu_offload,
            prefetch=parallelism.fsdp_prefetch,
        )
    if dims.dp_replicate_enabled:
        return apply_replicate(model, blocks, dims.mesh("dp_replicate"), mp_policy=mp_policy)
    return model


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool,
    sequence_parallel: bool,
    float8_styles: bool = False,
) -> None:
    """Megatron-style TP: attention heads and FFN hidden units split over ``tp_mesh``.

    q/k/v and w1/w3 are column-parallel (each rank computes its heads / hidden units), wo and
    w2 row-parallel (partial sums reduced at the end). With sequence parallelism the activations
    between those regions are sharded along the sequence (dim 1), so norms and residual adds
    run on 1/tp of the tokens and the all-reduces become reduce-scatter + all-gather. With loss
    parallelism the logits stay sharded over the vocabulary into the cross-entropy. With
    ``float8_styles`` float8 linears get torchao's float8 styles (each region's input cast to
    float8 once, before its all-gather).
    """
    between = Shard(1) if sequence_parallel else Replicate()
    apply_tp_embedding_and_output(
        model, tp_mesh, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel
    )

    style = functools.partial(tp_style, float8=float8_styles)
    for block in model.layers.values():
        attn, ffn = block.attention, block.feed_forward
        plan = {
            # The RoPE table and the document numbers (or None) are plain, replicated tensors.
            "attention": style(
                PrepareModuleInput,
                [attn.wq, attn.wk, attn.wv],
                input_layouts=(between, None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "attention.wq": style(ColwiseParallel, [attn.wq]),
            "attention.wk": style(ColwiseParallel, [attn.wk]),
            "attention.wv": style(ColwiseParallel, [attn.wv]),
            "attention.wo": style(RowwiseParallel, [attn.wo], output_layouts=between),
            "feed_forward": style(
                PrepareModuleInput,
                [ffn.w1, ffn.w3],
                input_layouts=(between,),
                desired_input_layouts=(Replicate(),),
            ),
            "feed_forward.w1": style(ColwiseParallel, [ffn.w1]),
            "feed_forward.w2": style(RowwiseParallel, [ffn.w2], output_layouts=between),
            "feed_forward.w3": style(ColwiseParallel, [ffn.w3]),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        if attn.q_norm is not None:
            # Each rank normalizes its own heads (dim 2) with the one replicated weight, whose
            # gradient DTensor then sums over the ranks' heads.
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)

"""How Llama 3 is parallelized: which modules each technique wraps. Plans only, no machinery.

Order: float8 -> tensor parallel -> context parallel -> expert parallel -> LoRA adapters ->
activation checkpointing -> torch.compile -> data parallel (FSDP). float8 swaps linear modules,
so it comes before anything wraps them. TP then because it rewrites parameters into DTensors that the later
wrappers must see; CP hooks the attention product inside the block, before anything wraps the
block; EP shards the routed experts' weights before anything wraps the blocks; LoRA adapters
take their placements from the weights TP placed, and exist before FSDP shards; AC wraps the
TP'd block so recomputation replays its collectives (the CP ring included); compile traces the
block with its checkpointing; FSDP last so it shards (and gathers) the final parameters of each
unit, over dp_shard x cp (the experts under EP over the data-parallel ranks EP leaves). Flavors
with experts (Qwen3's MoE sizes) take the mixture-of-experts plans shared with DeepSeek-V3
(``models/common/parallelize.py``).
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

from torchtitan.components import float8, lora
from torchtitan.components.float8 import tp_style
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.tensor_parallel import (
    ShardParameters,
    apply_tp_embedding_and_output,
    enable_async_tp,
)
from torchtitan.models.common.parallelize import (
    apply_data_parallel,
    apply_moe_cp_and_ep,
    compile_blocks,
    moe_tp_plan,
    routed_experts,
)
from torchtitan.models.spec import ParallelizeContext


def parallelize_llama3(model: nn.Module, context: ParallelizeContext) -> nn.Module:
    """Apply every technique ``context`` asks for to ``model`` (one model part)."""
    dims, parallelism, compile = context.parallel_dims, context.parallelism, context.compile
    experts = routed_experts(model)
    if context.float8.enable:  # first: the parallel plans then wrap float8 linears
        float8.apply_to_model_part(model, context.float8, context.training, dims, compile)
    if dims.tp_enabled:
        tp_mesh = dims.mesh("tp")
        sequence_parallel = parallelism.enable_sequence_parallel
        apply_tp(
            model,
            tp_mesh,
            loss_parallel=not parallelism.disable_loss_parallel,
            sequence_parallel=sequence_parallel,
            # torchao's styles cast a layer's input to float8 before LoRA's adapter reads it
            float8_styles=context.lora.rank == 0
            and float8.tp_in_float8(context.float8, tp_mesh, sequence_parallel=sequence_parallel),
            split_tokens=dims.ep_enabled,
        )
        if parallelism.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)
    if dims.cp_enabled:
        apply_cp(
            [block.attention.sdpa for block in model.layers.values()],
            dims.mesh("cp"),
            rotate_method=parallelism.context_parallel_rotate_method,
            load_balance=parallelism.context_parallel_load_balance,
            # Block-causal masks, sinks, windows and chunks need the whole sequence's K/V on
            # each rank.
            gather=context.attn_mask == "block_causal"
            or model.args.attention_sinks
            or model.args.sliding_window > 0
            or model.args.attention_chunk > 0,
        )
    apply_moe_cp_and_ep(model, context)
    lora.add_adapters(model, context.lora)  # placed from the weights TP just placed
    apply_ac(model.layers, context.activation_checkpoint)
    compile_blocks(model, context)
    return apply_data_parallel(model, context, experts)


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool,
    sequence_parallel: bool,
    float8_styles: bool = False,
    split_tokens: bool = False,
) -> None:
    """Megatron-style TP: attention heads and FFN hidden units split over ``tp_mesh``.

    q/k/v and w1/w3 are column-parallel (each rank computes its heads / hidden units), wo and
    w2 row-parallel (partial sums reduced at the end). With sequence parallelism the activations
    between those regions are sharded along the sequence (dim 1), so norms and residual adds
    run on 1/tp of the tokens and the all-reduces become reduce-scatter + all-gather. With loss
    parallelism the logits stay sharded over the vocabulary into the cross-entropy. With
    ``float8_styles`` float8 linears get torchao's float8 styles (each region's input cast to
    float8 once, before its all-gather). A block with experts takes
    ``models.common.parallelize.moe_tp_plan`` for them (``split_tokens``: expert parallelism
    spans the TP ranks).
    """
    between = Shard(1) if sequence_parallel else Replicate()
    apply_tp_embedding_and_output(
        model, tp_mesh, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel
    )

    style = functools.partial(tp_style, float8=float8_styles)
    for block in model.layers.values():
        attn = block.attention
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
        }
        if block.moe_enabled:
            plan |= moe_tp_plan(block, tp_mesh, between=between, split_tokens=split_tokens)
        else:
            ffn = block.feed_forward
            plan |= {
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
        if attn.sinks is not None:  # one per query head: each rank its heads'
            parallelize_module(attn, tp_mesh, ShardParameters({"sinks": 0}))

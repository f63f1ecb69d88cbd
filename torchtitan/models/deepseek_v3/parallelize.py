"""How DeepSeek-V3 is parallelized: which modules each technique wraps. Plans only.

Order: float8 (linear layers; the routed experts stay in high precision) -> tensor parallel ->
context parallel -> expert parallel -> LoRA adapters -> activation checkpointing -> torch.compile
-> data parallel (FSDP), for Llama 3's reasons (``models/llama3/parallelize.py``);
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

from torchtitan.components import float8, lora
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.tensor_parallel import (
    SumGradients,
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


def parallelize_deepseek_v3(model: nn.Module, context: ParallelizeContext) -> nn.Module:
    """Apply every technique ``context`` asks for to ``model`` (one model part)."""
    dims, parallelism = context.parallel_dims, context.parallelism
    experts = routed_experts(model)
    if context.float8.enable:  # first: the parallel plans then wrap float8 linears
        float8.apply_to_model_part(model, context.float8, context.training, dims, context.compile)
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
        apply_cp(
            [block.attention.sdpa for block in model.layers.values()],
            dims.mesh("cp"),
            rotate_method=parallelism.context_parallel_rotate_method,
            load_balance=parallelism.context_parallel_load_balance,
            gather=context.attn_mask == "block_causal",
        )
    apply_moe_cp_and_ep(model, context)
    lora.add_adapters(model, context.lora)  # placed from the weights TP just placed
    apply_ac(model.layers, context.activation_checkpoint)
    compile_blocks(model, context)
    return apply_data_parallel(model, context, experts)


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

    Mixture-of-experts layers: ``models.common.parallelize.moe_tp_plan`` (``split_tokens``:
    expert parallelism spans the TP ranks, each routing its own sequence shard).
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
        if block.moe_enabled:
            plan |= moe_tp_plan(block, tp_mesh, between=between, split_tokens=split_tokens)
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

"""Activation checkpointing: recompute activations in backward instead of keeping them.

Modes (``--activation_checkpoint.mode``):

- ``full``: every block keeps only its input; everything inside is recomputed.
- ``selective`` with ``--activation_checkpoint.selective_ac_option N``: every N-th block is
  fully checkpointed, the others keep all activations.
- ``selective`` with option ``op``: every block keeps the outputs of the expensive ops
  (attention, and every other matmul) and recomputes the cheap ones (norms, activations).
- ``memory_budget``: no wrapper; torch.compile's min-cut partitioner decides, in each compiled
  block, which activations to keep within ``--activation_checkpoint.memory_budget``
  (``distributed/compile.py``).
"""

import functools
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.job_config import ActivationCheckpoint

_aten = torch.ops.aten

# Outputs worth keeping: recomputing them costs real FLOPs or a collective.
_SAVE_LIST = {
    _aten.mm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,  # block-causal attention on CUDA
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # Keeping the max of a softmax avoids a second pass over its input.
    _aten.max.default,
}


def _op_policy() -> Callable:
    """Save every op in the save list except every second matmul.

    The same decisions must come out during the forward and during the recompute (torch 2.11
    asks again when recomputing and pops saved outputs by that answer; 2.13 asks only in
    forward), so each pass counts its matmuls separately, from zero at each new forward.
    """
    counts: defaultdict[bool, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is _aten.mm.default:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_LIST else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        counts.clear()
        return create_selective_checkpoint_contexts(policy)

    return context_fn


def apply_ac(blocks: nn.ModuleDict, config: ActivationCheckpoint) -> None:
    """Wrap the blocks of ``blocks`` (in place) according to ``config``."""
    if config.mode in ("none", "memory_budget"):  # the second: the compiler's (compile.py)
        return
    wrap = functools.partial(
        checkpoint_wrapper,
        preserve_rng_state=config.preserve_rng_state,
        determinism_check=config.determinism_check,
        debug=config.debug,
    )
    option = config.selective_ac_option  # checked by the config pre-flight: "op" or N >= 1
    for i, (name, block) in enumerate(list(blocks.items())):
        if config.mode == "full":
            wrapped = wrap(block)
        elif option == "op":
            wrapped = wrap(block, context_fn=_op_policy())
        elif i % int(option) == 0:
            wrapped = wrap(block)
        else:
            continue
        blocks[name] = wrapped

"""The part of attention that sees whole sequences, as its own module.

A model's attention projects queries, keys and values and applies RoPE; the product over the
sequence happens in :class:`ScaledDotProductAttention`. Keeping it a module of its own lets
parallel plans reach it by name: context parallelism (``distributed/context_parallel.py``)
hooks it so the product runs as ring attention over the ranks that split the sequence.
"""

import torch
import torch.nn.functional as F
from torch import nn


class ScaledDotProductAttention(nn.Module):
    """Causal attention of queries ``[bs, h, seq, hd]`` over keys and values
    ``[bs, kv_h, seq, hd]``; grouped-query when ``kv_h < h`` (K/V heads are broadcast, not
    copied). No parameters."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )

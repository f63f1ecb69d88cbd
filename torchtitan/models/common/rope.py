"""Rotary position embedding applied as complex rotations of consecutive pairs of a head's
dims; each family computes its own table of rotations (Llama 3.1 scaling, YaRN)."""

import torch


def apply_rope(xq: torch.Tensor, xk: torch.Tensor, rope_cis: torch.Tensor):
    """Rotate queries ``[bs, seq, h, hd]`` and keys ``[bs, seq, kv_h, hd]`` by position.

    ``rope_cis`` is the table ``[>= seq, hd // 2]`` (token i at position i) or each token's own
    rotation ``[bs, seq, hd // 2]`` (explicit positions, e.g. a context-parallel shard)."""
    seq = xq.shape[1]
    cis = rope_cis[:seq].view(1, seq, 1, -1) if rope_cis.dim() == 2 else rope_cis.unsqueeze(2)
    xq_c = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_c = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_c * cis).flatten(3)
    xk_out = torch.view_as_real(xk_c * cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)

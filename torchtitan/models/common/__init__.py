"""Building blocks that more than one model family uses (attention kernels, RoPE, MoE)."""

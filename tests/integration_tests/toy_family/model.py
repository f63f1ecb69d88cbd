"""The toy model (plain modules) and its parallelization plan (FSDP over the blocks)."""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.distributed import precision
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.fsdp import apply_fsdp, mixed_precision_policy
from torchtitan.models.spec import ParallelizeContext


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ToyModel(nn.Module):
    """Embedding -> per-token MLP blocks -> output: ``tokens [bs, seq] -> logits``."""

    def __init__(self, args):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args.dim) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))


def parallelize_toy(model: ToyModel, context: ParallelizeContext) -> nn.Module:
    """Activation checkpointing, then FSDP per block and on the root (no TP plan: refused by
    the family's ``validate``)."""
    apply_ac(model.layers, context.activation_checkpoint)
    dims = context.parallel_dims
    if not dims.fsdp_enabled:
        return model
    t = context.training
    return apply_fsdp(
        model,
        model.layers.values(),
        dims.mesh("dp_shard_cp"),
        mp_policy=mixed_precision_policy(precision.compute_dtype(t), t.mixed_precision_reduce),
        reshard_after_forward=context.parallelism.fsdp_reshard_after_forward,
        cpu_offload=t.enable_cpu_offload,
    )

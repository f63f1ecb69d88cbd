"""torch.compile per transformer block: each block compiles once and the graph is reused by
every block of the same shape, so compile time does not grow with depth."""

import torch
from torch import nn

from torchtitan.config.job_config import Compile


def apply_compile(blocks: nn.ModuleDict, config: Compile) -> None:
    """Replace each block of ``blocks`` with its compiled version (in place)."""
    for name, block in list(blocks.items()):
        blocks[name] = torch.compile(block, backend=config.backend, fullgraph=True)

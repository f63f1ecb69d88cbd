"""torch.compile per transformer block: each block compiles once and the graph is reused by
every block of the same shape, so compile time does not grow with depth.

A block with data-dependent shapes inside (a mixture-of-experts layer: rows per expert, the
expert-parallel exchange) compiles around them instead: :func:`apply_compile_around` compiles
each of its parts whole and leaves the named eager parts, and the glue between parts, eager.
"""

from collections.abc import Callable

import torch
from torch import nn

from torchtitan.config.job_config import Compile


def apply_compile(blocks: nn.ModuleDict, config: Compile) -> None:
    """Replace each block of ``blocks`` with its compiled version (in place)."""
    for name, block in list(blocks.items()):
        blocks[name] = _compiled(block, config)


def apply_compile_around(
    module: nn.Module, config: Compile, *, eager: Callable[[nn.Module], bool]
) -> None:
    """Compile each child of ``module`` whole (in place), except where ``eager(child)``: such
    a child runs eager and its own children are compiled the same way. An activation
    checkpointing wrapper is looked through (its recomputation then replays the compiled
    parts)."""
    inner = getattr(module, "_checkpoint_wrapped_module", module)
    for name, child in list(inner.named_children()):
        if eager(child):
            apply_compile_around(child, config, eager=eager)
        elif any(True for _ in child.parameters()):
            setattr(inner, name, _compiled(child, config))


def _compiled(module: nn.Module, config: Compile) -> nn.Module:
    return torch.compile(module, backend=config.backend, fullgraph=True)

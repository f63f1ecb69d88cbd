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


def uncache_graphs_with_collectives() -> None:
    """Turn off inductor's FX graph cache and AOTAutograd's cache for this process: for blocks
    whose graphs hold collectives (TP, CP). Their cache keys miss the process group's name,
    which depends on the layout: a graph cached by another layout's run named a group this one
    lacks (torch 2.13: ``Could not resolve the process group registered under the name 15``
    on ranks 2 and 3 of FSDP 2 x TP 2, after an EP 2 x TP 2 run compiled the same blocks).
    Compiled kernels are still cached; each run traces its graphs again."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


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
    compiled = torch.compile(module, backend=config.backend, fullgraph=True)
    compiled.register_forward_pre_hook(_copy_view_inputs, with_kwargs=True)
    return compiled


def _copy_view_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Give the compiled graph a copy of each input that is a view needing gradients (runs
    eager, before the graph). Such an input is what ``DTensor.to_local`` returns (the first
    block's input under tensor parallelism): AOTAutograd then rebuilds it from its base inside
    the graph, and on torch 2.13 the gradient reaches the DTensor redistribution behind it as a
    plain tensor (``'Tensor' object has no attribute '_local_tensor'``,
    ``scripts/repro_tp_compile.py``). The copy costs one activation-sized copy per view."""

    def copy(x):
        if isinstance(x, torch.Tensor) and x.requires_grad and x._base is not None:
            return x.clone()
        return x

    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}

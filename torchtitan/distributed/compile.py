"""torch.compile per transformer block: each block compiles once and the graph is reused by
every block of the same shape, so compile time does not grow with depth.

A block with data-dependent shapes inside (a mixture-of-experts layer: rows per expert, the
expert-parallel exchange) compiles around them instead: :func:`apply_compile_around` compiles
each of its parts whole and leaves the named eager parts, and the glue between parts, eager.

With ``memory_budget`` (``--activation_checkpoint.mode memory_budget``) each compiled graph's
activations are chosen by AOTAutograd's min-cut partitioner within that budget: the graph
compiles (and recompiles) under it, scoped to the compiled module's calls rather than set for
the whole process. One budget per process: dynamo reuses a block class's graph without
looking at the budget, so a caller compiling again under another one (a test, a notebook)
calls ``torch._dynamo.reset()`` first.
"""

from collections.abc import Callable

import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Compile, Parallelism
from torchtitan.distributed.parallel_dims import ParallelDims


def graphs_hold_collectives(dims: ParallelDims, parallelism: Parallelism) -> bool:
    """Whether compiled blocks trace collectives: TP's, CP's ring, or the parameter gathers
    of DTensor-parametrized FSDP (``--parallelism.fsdp_impl simple``)."""
    simple_fsdp = parallelism.fsdp_impl == "simple"
    return dims.tp_enabled or dims.cp_enabled or (simple_fsdp and dims.dp_enabled)


def apply_compile(
    blocks: nn.ModuleDict,
    config: Compile,
    *,
    tensor_parallel: bool = False,
    collectives: bool = False,
    memory_budget: float | None = None,
) -> None:
    """Replace each block of ``blocks`` with its compiled version (in place).

    ``tensor_parallel``: the blocks run DTensor ops (see :func:`_copy_view_inputs`).
    ``collectives``: the graphs hold collectives (TP, CP, DTensor-parametrized FSDP); see
    :func:`_uncache_graphs`. ``memory_budget``: the activations' budget of each graph (see
    :func:`_within_budget`), or None for the partitioner's default."""
    if collectives:
        _uncache_graphs()
    for name, block in list(blocks.items()):
        blocks[name] = _compiled(block, config, tensor_parallel, memory_budget, collectives)


def apply_compile_around(
    module: nn.Module,
    config: Compile,
    *,
    eager: Callable[[nn.Module], bool],
    tensor_parallel: bool = False,
    collectives: bool = False,
    memory_budget: float | None = None,
) -> None:
    """Compile each child of ``module`` whole (in place), except where ``eager(child)``: such
    a child runs eager and its own children are compiled the same way. An activation
    checkpointing wrapper is looked through (its recomputation then replays the compiled
    parts). ``tensor_parallel``, ``collectives`` and ``memory_budget`` as for
    :func:`apply_compile`."""
    if collectives:
        _uncache_graphs()
    inner = getattr(module, "_checkpoint_wrapped_module", module)
    for name, child in list(inner.named_children()):
        if eager(child):
            apply_compile_around(
                child, config, eager=eager, tensor_parallel=tensor_parallel,
                collectives=collectives, memory_budget=memory_budget,
            )  # fmt: skip
        elif any(True for _ in child.parameters()):
            compiled = _compiled(child, config, tensor_parallel, memory_budget, collectives)
            setattr(inner, name, compiled)


def backend(config: Compile) -> str:
    """``--compile.backend``, refused in one line where torch.compile has no backend of that
    name (torch's own error comes from deep inside the first compile, on every rank)."""
    from torch._dynamo.backends.registry import list_backends, lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(config.backend)
    except InvalidBackend:
        raise ConfigError(
            f"--compile.backend {config.backend} is not a torch.compile backend here; use "
            f"inductor (the default), eager or aot_eager to debug, or one of "
            f"{', '.join(b for b in list_backends() if b != 'inductor')}"
        ) from None
    return config.backend


def _compiled(
    module: nn.Module,
    config: Compile,
    tensor_parallel: bool,
    memory_budget: float | None,
    collectives: bool,
) -> nn.Module:
    compiled = torch.compile(module, backend=backend(config), fullgraph=True)
    if tensor_parallel:
        compiled.register_forward_pre_hook(_copy_view_inputs, with_kwargs=True)
    if memory_budget is not None:
        compiled.forward = _within_budget(compiled.forward, memory_budget, collectives)
    return compiled


def _within_budget(forward: Callable, budget: float, collectives: bool) -> Callable:
    """``forward`` (a compiled module's) run with AOTAutograd's activation memory budget set
    to ``budget``: the min-cut partitioner, which splits each graph into forward and backward
    when the forward compiles, keeps the activations that fit and recomputes the rest in
    backward, cheapest first (0: about what full checkpointing of the graph keeps; 1: all it
    would keep). Set around each call, not for the process. The on-disk caches (AOTAutograd's,
    inductor's FX graphs) key on it; dynamo's in-process one does not (see the module).

    A graph holding ``collectives`` (TP, CP) takes its process group as an opaque object,
    whose size the partitioner of torch 2.13 refuses to guess unless told to count it as
    nothing: right for a process group, which holds no activations."""
    import torch._functorch.config

    settings: dict = {"activation_memory_budget": budget}
    if collectives and hasattr(torch._functorch.config, "unsafe_treat_script_objects_as_zero_size"):
        settings["unsafe_treat_script_objects_as_zero_size"] = True

    def run(*args, **kwargs):  # no functools.wraps: it would copy dynamo's markers over
        with torch._functorch.config.patch(**settings):
            return forward(*args, **kwargs)

    return run


def _copy_view_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Give the compiled graph a copy of each input that is a view needing gradients (runs
    eager, before the graph). Under tensor parallelism the first block's input is what
    ``DTensor.to_local`` returns, a view: AOTAutograd rebuilds it from its base inside the
    graph, and on torch 2.13 its gradient then reaches the DTensor redistribution behind it as
    a plain tensor (``'Tensor' object has no attribute '_local_tensor'``;
    ``scripts/repro_tp_compile.py``). Costs one activation-sized copy per view per forward
    (the first block's input; in MoE layers the flattened input of the router and shared
    experts), and again in a recomputation."""

    def copy(x):
        if isinstance(x, torch.Tensor) and x.requires_grad and x._base is not None:
            return x.clone()
        return x

    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}


def _uncache_graphs() -> None:
    """Turn off inductor's FX graph cache and AOTAutograd's cache, for the rest of this
    process (torch's global config; never turned back on): the cache keys of graphs holding
    collectives miss the process groups' names, which depend on the layout and on the groups
    made before. A graph cached by another layout's run named a group this one lacks (torch
    2.13: ``Could not resolve the process group registered under the name 15`` on ranks 2 and
    3 of FSDP 2 x TP 2, in a launch after other layouts had compiled the same blocks; with
    the caches off, or empty, it trained). Compiled kernels are still cached; each run traces
    its graphs again."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False

"""Python garbage collection at fixed steps instead of at random moments, and
``--training.gc_debug``: the reference cycles that held tensors, found and named every step.

A tensor inside a reference cycle is freed only when the cycle collector runs, not when the
step that made it drops it: its memory stays held for up to ``--training.gc_freq`` steps, and
on a GPU the allocator sees a different pattern from step to step. The debug mode collects
every step with ``gc.DEBUG_SAVEALL``, so that what the collector would free is kept for a
look: the tensors among it are named in one warning line (count, bytes, the largest shapes,
and the attributes that hold the largest, followed from the cycle down to it), and every
tensor's holders are listed in a file next to the run's other dumps."""

import contextlib
import gc
import reprlib
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtitan.tools.logging import logger
from torchtitan.tools.memory_estimate import format_bytes

GC_DEBUG_FOLDER = "gc_debug"
"""Under ``--job.dump_folder``: ``rank<R>_step<N>.txt``, each tensor found and what holds it."""


@contextlib.contextmanager
def gc_every(
    freq: int, *, debug: bool = False, dump_folder: str | None = None, rank: int = 0
) -> Iterator[Callable[[int], None]]:
    """Disable automatic GC during training and collect every ``freq`` steps instead, so
    collection pauses happen on all ranks at the same step rather than at random. Yields
    ``tick(step)``, called at the start of every step. With ``debug``, every step collects
    everything and reports the cycles that held tensors, at the start of each step and after
    the last one (``dump_folder``: where each tensor's holders are listed; ``None``:
    nowhere)."""
    if freq <= 0 and not debug:
        yield lambda step: None
        return
    ticked = [0]
    frozen = debug and gc.get_freeze_count() == 0  # someone else's freeze stays theirs

    def tick(step: int) -> None:
        ticked[0] = step
        if debug:
            report_tensor_cycles(step, dump_folder=dump_folder, rank=rank)
        elif step > 1 and step % freq == 0:
            gc.collect(1)

    gc.disable()
    try:
        gc.collect(2 if debug else 1)  # the build's own cycles are not the training loop's
        if frozen:
            # What exists now (modules, the model, the optimizer) is left out of every later
            # collection: each step's full collection looks at the objects made since (a full
            # collection of everything cost 0.48 s per step on the debug model).
            gc.freeze()
        if debug:
            logger.info(
                "--training.gc_debug: collecting every step; tensors held by reference cycles "
                "will be named (slower steps)"
            )
        yield tick
        if debug and ticked[0]:  # the last step's garbage
            report_tensor_cycles(ticked[0], dump_folder=dump_folder, rank=rank, after=True)
    finally:
        if frozen:
            gc.unfreeze()
        gc.enable()


def report_tensor_cycles(
    step: int, *, dump_folder: str | None, rank: int, after: bool = False
) -> int:
    """Collect every generation, keeping what the collector finds; if tensors are among it,
    warn once and list each one's holders; then free it. ``step``: the step about to start
    (``after``: the step just ended). Returns how many tensors were found."""
    previous = gc.get_debug()
    gc.set_debug(previous | gc.DEBUG_SAVEALL)
    before = len(gc.garbage)  # what others left there stays theirs
    try:
        gc.collect(2)
        garbage = gc.garbage[before:]
        del gc.garbage[before:]
    finally:
        gc.set_debug(previous)
    try:
        return _report(garbage, step, dump_folder, rank, after=after)
    except Exception as e:  # finalized objects can fail any look; the run goes on
        logger.warning(f"--training.gc_debug: could not look at step {step}'s garbage: {e!r}")
        return 0
    finally:
        garbage.clear()
        gc.collect(2)  # now free them, and what they held


def _report(garbage: list, step: int, dump_folder: str | None, rank: int, *, after: bool) -> int:
    # A weak proxy whose object is gone raises on any look (compiled code leaves such).
    garbage = [obj for obj in garbage if type(obj) not in weakref.ProxyTypes]
    tensors = _plain_tensors(garbage)
    if tensors:
        tensors.sort(key=lambda t: t.numel() * t.element_size(), reverse=True)
        chains = _chains(tensors, garbage)
        name = f"step{step}_end" if after else f"step{step}"
        when = f"at the end of step {step}" if after else f"at the start of step {step}"
        listing = _write_listing(chains, dump_folder, rank, name, when)
        logger.warning(
            f"--training.gc_debug: {_describe(tensors)} in reference cycles that only the "
            f"garbage collector frees (found {when}: made in step "
            f"{step if after else step - 1} or before); the largest is {chains[0]}"
            + (f"; each one's holders: {listing}" if listing else "")
        )
    return len(tensors)


def _holds_memory(obj: object) -> bool:
    """A tensor with memory: not fake, not on the meta device."""
    return (
        isinstance(obj, torch.Tensor)
        and not isinstance(obj, FakeTensor)
        and obj.device.type != "meta"
    )


def _plain_tensors(objects: list) -> list[torch.Tensor]:
    """The plain tensors with memory among ``objects``, a wrapper subclass's (a DTensor's
    local shard, a float8 tensor's data and scale) in its place; each once."""
    found: dict[int, torch.Tensor] = {}
    todo = [obj for obj in objects if _holds_memory(obj)]
    while todo:
        t = todo.pop()
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            todo += [getattr(t, name) for name in names if _holds_memory(getattr(t, name))]
        elif type(t) in (torch.Tensor, torch.nn.Parameter):
            found[id(t)] = t
    return list(found.values())


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def _describe(tensors: list[torch.Tensor]) -> str:
    """Count, bytes (each storage once) and the largest shapes of ``tensors`` (largest
    first)."""
    storages: dict[tuple[str, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    held = sum(storages.values())
    total = (
        format_bytes(held).strip()
        if held >= 2**20
        else f"{held / 2**10:.1f} KiB"
        if held >= 2**10
        else f"{held} B"
    )
    shapes = ", ".join(_shape(t) for t in tensors[:3])
    more = f", and {len(tensors) - 3} more" if len(tensors) > 3 else ""
    return f"{len(tensors)} tensor(s) holding {total} ({shapes}{more})"


def _chains(tensors: list[torch.Tensor], garbage: list, *, limit: int = 8) -> list[str]:
    """For each tensor, what holds it: the attributes, keys or locals followed from a member
    of the cycle down to it (``_Node.other -> _Node.tensor``), at most ``limit`` long."""
    members = {id(obj) for obj in garbage}
    holders: dict[int, list] = {}
    # Every edge first: reading an instance's __dict__ for a label makes it a separate object.
    for obj in garbage:
        for ref in gc.get_referents(obj):
            if id(ref) in members:
                holders.setdefault(id(ref), []).append(obj)
    chains = []
    for t in tensors:
        # A wrapper subclass's inner tensor is held by the wrapper, which is in the garbage.
        node, path, seen = t, [], {id(t)}
        while len(path) < limit and (held_by := holders.get(id(node))):
            holder = held_by[0]
            path.append(f"{_type_name(holder)}{_edge(holder, node)}")
            if id(holder) in seen:
                break  # the cycle closes
            seen.add(id(holder))
            node = holder
        chains.append(" -> ".join(reversed(path)) + f" ({_shape(t)})" if path else _shape(t))
    return chains


def _type_name(obj: object) -> str:
    return type(obj).__qualname__


def _edge(holder: object, held: object) -> str:
    """How ``holder`` refers to ``held``: ``.name``, ``[key]``, ``[i]`` or a frame's local."""
    if isinstance(holder, dict):
        key = next((k for k, v in holder.items() if v is held), None)
        return f"[{reprlib.repr(key)}]" if key is not None else ""
    if isinstance(holder, (list, tuple)):
        index = next((i for i, v in enumerate(holder) if v is held), None)
        return f"[{index}]" if index is not None else ""
    if isinstance(holder, types.FrameType):
        name = next((k for k, v in holder.f_locals.items() if v is held), None)
        return f" {holder.f_code.co_name}() local {name}" if name else ""
    if isinstance(holder, types.CellType):
        return ".cell_contents"
    if isinstance(holder, torch.Tensor) and is_traceable_wrapper_subclass(holder):
        names, _ = holder.__tensor_flatten__()  # a DTensor's _local_tensor
        name = next((n for n in names if getattr(holder, n) is held), None)
        if name is not None:
            return f".{name}"
    if getattr(holder, "__dict__", None) is held:
        return ".__dict__"
    attrs = getattr(holder, "__dict__", None)
    if isinstance(attrs, dict):
        name = next((k for k, v in attrs.items() if v is held), None)
        if name is not None:
            return f".{name}"
    return ""


def _write_listing(
    chains: list[str], dump_folder: str | None, rank: int, name: str, when: str
) -> Path | None:
    """Each tensor's holders, one per line, under ``dump_folder`` (``None``: nowhere)."""
    if dump_folder is None:
        return None
    listing = Path(dump_folder) / GC_DEBUG_FOLDER / f"rank{rank}_{name}.txt"
    try:
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.write_text(
            f"Tensors in reference cycles found {when} on rank {rank}, "
            "largest first, each with what holds it:\n" + "".join(f"{c}\n" for c in chains)
        )
    except OSError as e:  # the listing is a help; the warning is the report
        logger.warning(f"--training.gc_debug: could not write {listing}: {e}")
        return None
    return listing

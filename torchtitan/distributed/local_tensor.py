"""``COMM_MODE=local_tensor``: every rank of a run simulated in one process, with real numerics.

``torch.distributed._local_tensor.LocalTensorMode`` makes each tensor a ``LocalTensor`` that
holds one value per simulated rank; ordinary ops run once per rank and collectives on a
process group combine the ranks' values as the real collective would. The process group itself
is the ``fake`` backend (world size N, this process is rank 0): it only names the groups,
the mode does the work. Model code and DTensor code run unchanged; what differs is anything
that is *not* a tensor op:

- Python numbers are the same on every rank: ``dist.all_reduce`` of a tensor made from a
  Python number goes straight to the fake backend and returns it *unreduced*. Reduce tensors
  that came out of the model or out of :func:`replicate_to_ranks`.
- ``.item()`` / ``int()`` / ``float()`` of a ``LocalTensor`` succeed only when every rank holds
  the same value (after a reduction); otherwise ``.item()`` raises ``AssertionError`` and
  ``int()`` ``AttributeError``.
- Per-rank inputs (each data-parallel rank its own batch) are built with
  :func:`for_each_coordinate` (e.g. of the ``dp`` mesh); one rank's own value is read with
  :func:`value_on_rank`.

These helpers also work in a real multi-process run, where they act on this rank only.
"""

import contextlib
import os
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed import _local_tensor
from torch.distributed._local_tensor import (
    LocalTensor,
    LocalTensorMode,
    enabled_local_tensor_mode,
    maybe_run_for_local_tensor,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.tools.logging import logger
from torchtitan.tools.module_names import clean_name

_T = TypeVar("_T")


def simulation_mode(ranks: int | frozenset[int]) -> LocalTensorMode:
    """``LocalTensorMode`` over ``ranks`` (a world size, or the ranks themselves), with torch's
    per-mode cache of mesh coordinates made safe first (:func:`_guard_mesh_coordinates`).
    Every simulation in torchtitan enters its mode through here."""
    _guard_mesh_coordinates()
    return LocalTensorMode(ranks)


def _guard_mesh_coordinates() -> None:
    """Keep a dead mesh's coordinates from being handed to a new mesh.

    Under ``LocalTensorMode`` (torch 2.11-2.13), ``DeviceMesh.get_coordinate`` caches each
    mesh's per-rank coordinates in the mode under ``id(mesh)`` and never drops them. Meshes
    come and go (``mesh["tp"]`` builds a new object each time); one made after another died
    can get its address, hence its id, and silently receives the dead mesh's coordinates
    (pytorch/pytorch#184526, fixed upstream by keying on the mesh's layout). In the EP x TP
    simulation this showed as a rare wrong embedding gradient: the ``tp`` mesh of the
    parameter gather landed on a dead ``(efsdp, ep)`` mesh, so the vocabulary shards of the
    gradient went to ranks by their ``efsdp`` coordinate.

    Wraps torch's implementation (installed once per process): each cache entry is tied to a
    weak reference to the mesh that filled it, dropped when that mesh dies, and ignored if
    another mesh asks under the same id. Harmless on a torch without the id-keyed cache.
    """
    local_mesh = getattr(_local_tensor, "_LocalDeviceMesh", None)
    torch_get = getattr(local_mesh, "get_coordinate", None)
    if torch_get is None or getattr(torch_get, "_torchtitan_guarded", False):
        return

    def get_coordinate(mesh):
        mode = enabled_local_tensor_mode()
        cache = getattr(mode, "_coordinate_cache", None)
        if cache is not None:
            owners = mode.__dict__.setdefault("_torchtitan_coordinate_owners", {})
            key = id(mesh)
            owner = owners.get(key)
            if owner is None or owner() is not mesh:
                cache.pop(key, None)

                def forget(ref: weakref.ref, key: int = key) -> None:
                    if owners.get(key) is ref:  # still this mesh's entry: drop both
                        del owners[key]
                        cache.pop(key, None)

                owners[key] = weakref.ref(mesh, forget)
        return torch_get(mesh)

    get_coordinate._torchtitan_guarded = True
    local_mesh.get_coordinate = staticmethod(get_coordinate)


@contextlib.contextmanager
def local_tensor_mode(world_size: int) -> Iterator[LocalTensorMode]:
    """Simulate ``world_size`` ranks in this process until the block ends.

    Starts the ``fake`` process group (rank 0 of ``world_size``) and enters ``LocalTensorMode``
    over all ranks; build meshes, model and data inside. Tensors created inside are
    ``LocalTensor``s: do not use them after the block.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "COMM_MODE=local_tensor runs as one process without torchrun: a process group "
            "already exists; launch with NGPU=<ranks to simulate> and no torchrun"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with simulation_mode(world_size) as mode:
            yield mode
    finally:
        dist.destroy_process_group()


def run(comm_mode: str, pipeline_degree: int, fn: Callable[[int], None]) -> None:
    """The trainer's way in: ``fn(pp_rank)`` runs one whole job.

    Without ``comm_mode="local_tensor"``: ``fn(0)``, once (this process is one real rank).
    Under it: ``fn`` runs inside ``LocalTensorMode`` over the ``WORLD_SIZE`` ranks (``NGPU``
    of ``run_train.sh``); the process group (``fake``) is made inside, by
    ``init_distributed``. With pipeline parallelism, once per pipeline rank, each in its
    own thread simulating that rank's share of the world (``local_pipeline``).
    """
    if comm_mode != "local_tensor":
        fn(0)
        return
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    logger.warning(
        f"COMM_MODE=local_tensor: Simulating {world_size} ranks in one process. Losses and "
        "gradients are those of the real run; speed and memory are not (every op runs once "
        "per rank, one after the other). The metrics show rank 0's view."
    )
    if pipeline_degree == 1:
        with simulation_mode(world_size):
            fn(0)
        return
    from torchtitan.distributed import local_pipeline

    local_pipeline.run(world_size, pipeline_degree, fn)


def same_int(value: int | torch.SymInt) -> int:
    """``value`` as an ``int`` where it is the same on every simulated rank (e.g. a pipeline
    thread's ``pp`` coordinate); raises ``ValueError`` where the ranks differ."""
    if isinstance(value, torch.SymInt):
        as_int = value.node.maybe_as_int()
        if as_int is None:
            raise ValueError(f"{value} differs across the simulated ranks")
        return as_int
    return int(value)


def own_rank() -> int:
    """The rank whose view this process (or, under the pipeline simulation, this thread)
    logs and saves: ``RANK``, or the first rank the thread simulates."""
    from torchtitan.distributed import local_pipeline

    first = local_pipeline.first_rank()
    return first if first is not None else int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    """Plain tensors inside the block even while simulating (building the one-process model,
    reading data): ``LocalTensorMode`` is paused."""
    mode = enabled_local_tensor_mode()
    with mode.disable() if mode is not None else contextlib.nullcontext():
        yield


class PerRankBatches:
    """Batches for every simulated rank from one dataloader per data-parallel rank.

    Each step reads one batch from every loader (outside the mode) and hands out batches
    whose tensors hold, on simulated rank r, the batch of r's data-parallel coordinate, as
    ``dp_world_size`` separate processes would each read their own. Loaders are indexed by
    data-parallel rank; ``dp_rank`` is ``parallel_dims.mesh("dp").get_local_rank()``.
    """

    def __init__(self, loaders: Sequence[Iterable], dp_rank: int | torch.SymInt):
        self.loaders = list(loaders)
        self.dp_rank = dp_rank

    def __iter__(self) -> Iterator:
        iters = [iter(loader) for loader in self.loaders]
        while True:
            with host_only():
                try:
                    batches = [next(it) for it in iters]
                except StopIteration:
                    return
            yield for_each_coordinate(batches.__getitem__, self.dp_rank)


def dataloader_for_rank(build: Callable[[int], Iterable], dp_rank: int, dp_degree: int) -> Iterable:
    """``build(dp_rank)``, this rank's dataloader; while simulating, one process reads for
    every data-parallel rank (:class:`PerRankBatches` over ``build(r)`` for each ``r``)."""
    if not is_simulating():
        return build(dp_rank)
    return PerRankBatches([build(r) for r in range(dp_degree)], dp_rank)


def is_simulating() -> bool:
    """True inside :func:`local_tensor_mode` (and not inside its ``disable()``)."""
    return enabled_local_tensor_mode() is not None


def for_each_coordinate(make: Callable[[int], _T], coordinate: int | torch.SymInt) -> _T:
    """``make(c)`` for every (simulated) rank's coordinate ``c`` along one mesh dimension.

    ``coordinate`` is ``mesh.get_local_rank()``: an ``int`` in a real run (the result is
    ``make(coordinate)``); under ``LocalTensorMode`` a per-rank ``SymInt``, and tensors in the
    result become ``LocalTensor``s whose value on rank r is ``make(coordinate of r)``, e.g. each
    data-parallel rank's batch (``dp`` mesh) or each context-parallel rank's positions (``cp``).
    Ranks that share a coordinate get equal copies. ``make`` must not run collectives or have
    side effects other than reading its own data; tensors it returns may be plain or
    ``LocalTensor``s equal on all ranks (anything built inside the mode).
    """

    def own(t: torch.Tensor) -> torch.Tensor:
        # Data made inside the mode is a LocalTensor equal on every rank: take that value.
        # Clone so simulated ranks never share storage (an in-place op would hit all of them).
        return t.reconcile() if isinstance(t, LocalTensor) else t.clone()

    specs = []

    def make_owned(rank: int) -> list:
        # Flat: the per-rank results are combined leaf by leaf only through lists and tuples.
        leaves, spec = pytree.tree_flatten(make(rank))
        specs.append(spec)
        return [own(x) if isinstance(x, torch.Tensor) else x for x in leaves]

    leaves = maybe_run_for_local_tensor(make_owned)(coordinate)
    return pytree.tree_unflatten(list(leaves), specs[0])


def replicate_to_ranks(value: torch.Tensor | float) -> torch.Tensor:
    """A tensor every (simulated) rank holds, fit to be all-reduced.

    Under ``LocalTensorMode`` a plain tensor or number becomes a ``LocalTensor`` with a copy
    per rank (the collectives only combine ``LocalTensor``s); elsewhere, a plain tensor.
    """
    t = torch.as_tensor(value)
    mode = enabled_local_tensor_mode()
    if mode is None or isinstance(t, LocalTensor):
        return t
    return mode.rank_map(lambda _: t.detach().clone())


def max_over_ranks(t: torch.Tensor) -> int:
    """The largest value any simulated rank holds of ``t`` (a ``LocalTensor``; a plain tensor:
    its largest value): a size every simulated rank can share."""
    values = t._local_tensors.values() if isinstance(t, LocalTensor) else [t]
    with host_only():
        return max(int(v.max()) for v in values)


def by_rank(t: torch.Tensor) -> list[tuple[int | None, torch.Tensor]]:
    """Each simulated rank with its value of ``t`` (a ``LocalTensor``); ``[(None, t)]`` for a
    plain tensor (this process's rank). Read them inside :func:`host_only`."""
    if isinstance(t, LocalTensor):
        return sorted(t._local_tensors.items())
    return [(None, t)]


def value_on_rank(t: torch.Tensor, rank: int) -> torch.Tensor:
    """What ``rank`` holds of ``t`` (a ``LocalTensor``); ``t`` itself for a plain tensor.

    For per-rank numbers that are logged, not reduced, e.g. rank 0's local loss.
    """
    return t._local_tensors[rank] if isinstance(t, LocalTensor) else t


@torch.no_grad()
def load_full_model_(model: nn.Module, full: nn.Module) -> None:
    """Give ``model`` (parallelized, any DTensor placements) the values of ``full`` (the same
    architecture on one process, already initialised).

    Every rank (simulated or real) holds ``full`` and cuts its own shards: no communication,
    so it works under ``LocalTensorMode``, where ``set_model_state_dict(...,
    broadcast_from_rank0=True)`` cannot. Parameters are replaced, not copied into: build the
    optimizer afterwards. Buffers (persistent or not) are taken from ``full`` as they are.
    """
    full_params = dict(full.named_parameters(remove_duplicate=False))
    full_buffers = dict(full.named_buffers(remove_duplicate=False))
    replaced: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            key = clean_name(prefix + name)
            if key not in full_params:
                raise KeyError(f"{key} is in the parallelized model but not in the full one")
            if id(param) not in replaced:
                value = _placed_like(param, full_params[key].detach())
                replaced[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = full_buffers[clean_name(prefix + name)].clone()


@torch.no_grad()
def copy_full_state_(
    model: nn.Module, state: dict[str, torch.Tensor], *, leave_out: Collection[str] = ()
) -> None:
    """Copy the whole model's values ``state`` (host tensors by parameter name, e.g. read from
    a checkpoint) into ``model``'s parameters, each simulated rank its own shards; parameters
    missing from ``state`` are an error (unless named in ``leave_out``: they keep their
    values), buffers are taken where ``state`` has them. Copies in place: the optimizer keeps
    its parameters."""
    for name, param in model.named_parameters():
        key = clean_name(name)
        if key in leave_out:
            continue
        if key not in state:
            raise KeyError(f"{key} is in the model but not in the loaded state")
        param.copy_(_placed_like(param, state[key].to(param.dtype)))
    for name, buf in model.named_buffers():
        key = clean_name(name)
        if key in state:
            buf.copy_(replicate_to_ranks(state[key].to(buf.dtype).clone()))


def _placed_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (the whole tensor, on the host) cut as ``param`` is placed: its shards for a
    DTensor, a copy on every simulated rank otherwise (no communication); in ``param``'s
    dtype (``--training.dtype``: a float32 initialisation cast)."""
    full = full.to(param.dtype)
    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return replicate_to_ranks(full.clone())

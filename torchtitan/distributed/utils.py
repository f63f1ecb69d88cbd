"""Process-group start-up and shutdown, determinism, and small cross-rank reductions."""

import datetime
import os
import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.config.errors import ConfigError
from torchtitan.distributed import local_tensor
from torchtitan.failure_records import LOST_PEER_MARKERS
from torchtitan.tools.logging import logger


def device_type() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(
    *,
    device: torch.device,
    init_timeout_seconds: int,
    trace_buf_size: int,
    comm_mode: str = "default",
) -> int:
    """Join the process group when launched by torchrun; return the world size.

    A plain ``python -m torchtitan.train`` (no ``WORLD_SIZE`` in the environment) runs as one
    process without a process group. ``comm_mode="fake_backend"`` makes this one process
    rank ``RANK`` of ``WORLD_SIZE`` on a fake process group whose collectives do nothing.
    """
    if dist.is_initialized():  # several trainers in one process (tests, notebooks)
        return dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if comm_mode in ("fake_backend", "local_tensor"):
        # Importing the module registers the "fake" backend with c10d.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        # local_tensor: the process is every rank; the group only names them (rank 0 of N).
        rank = int(os.environ.get("RANK", "0")) if comm_mode == "fake_backend" else 0
        if not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} must be in [0, NGPU={world_size}) for fake_backend")
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        return world_size
    if world_size == 1 and "RANK" not in os.environ:
        return 1
    # The flight recorder reads its buffer size when the process group is created.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(trace_buf_size))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=init_timeout_seconds),
        device_id=device if device.type == "cuda" else None,
    )
    return dist.get_world_size()


def local_device() -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` on GPU machines, else CPU."""
    if device_type() == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def set_determinism(seed: int | None, *, deterministic: bool, warn_only: bool) -> None:
    """Seed every RNG the same on all ranks and optionally force deterministic kernels."""
    if deterministic:
        logger.info("Deterministic algorithms are on (slower, bitwise reproducible)")
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # cuBLAS needs a fixed workspace to be deterministic.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if seed is None:
        return
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def shared_seed(seed: int | None, distributed: bool) -> int:
    """``seed``, or without one (``--debug.seed``) a seed rank 0 draws and shares with every
    rank (``distributed``): replicated state must be initialised alike everywhere."""
    if seed is not None:
        return seed
    drawn = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
    if distributed:
        dist.broadcast(drawn, src=0)
    return int(drawn)


def dist_reduce(x: torch.Tensor | float, op: str, mesh: DeviceMesh | None) -> float:
    """All-reduce a scalar over ``mesh`` (``sum`` or ``max``); identity without a mesh.

    A device tensor is reduced where it lives; a Python number stays on the host, where the
    ``cpu:gloo,cuda:nccl`` process group sends it through gloo without touching the GPU.
    When every rank is simulated in this process, pass the per-rank tensor: a Python number
    is one value, not one per rank.
    """
    if isinstance(x, DTensor):
        x = x.full_tensor()
    if not isinstance(x, torch.Tensor) and enabled_local_tensor_mode() is not None:
        raise TypeError("dist_reduce under COMM_MODE=local_tensor needs a per-rank tensor")
    t = torch.as_tensor(x).detach().to(torch.float64).clone()
    if mesh is None or mesh.size() == 1:
        return t.item()
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    dist.all_reduce(t, op=ops[op], group=mesh.get_group())
    return t.item()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, *, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Clip the global gradient norm; return it (before clipping) as a plain tensor.

    Gradients may be plain tensors (replicated) and DTensors on several meshes (FSDP, TP):
    each group's norm is computed on its own mesh, reduced to a full value, and the groups are
    combined. Under pipeline parallelism each rank holds only its stages' parameters: pass the
    ``pp`` mesh and the squared norms of all stages are summed over it. Every rank gets the
    norm of the whole model.

    First, gradients still partial over a mesh dimension where their parameter is not (a
    replicated norm weight read by sequence-parallel shards) are summed into the parameter's
    placement, once, before the norm and the optimizer read them: torch 2.11's
    ``clip_grads_with_norm_(foreach=True)`` leaves ``Partial`` gradients unscaled (2.13
    scales them), so under TP with sequence parallelism the norm weights were never clipped
    (TP 2 ended with norm weights 7e-4 away from one process's; 1e-5 with this).
    """
    parameters = list(parameters)
    for p in parameters:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            if any(placement.is_partial() for placement in p.grad.placements):
                p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
    groups: dict[DeviceMesh | None, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups[mesh].append(p)
    total = total_norm([p.grad for p in parameters if p.grad is not None], pp_mesh=pp_mesh)
    if max_norm > 0:
        for params in groups.values():
            # Takes the parameters (it scales their .grad), not the gradients themselves.
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def total_norm(
    tensors: Sequence[torch.Tensor], *, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """The 2-norm of all of ``tensors`` together (plain tensors and DTensors on any meshes;
    under pipeline parallelism summed over ``pp_mesh``'s stages), as a float32 tensor that is
    the same on every rank."""
    groups: dict[DeviceMesh | None, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.device_mesh if isinstance(t, DTensor) else None].append(t)
    norms = []
    for group in groups.values():
        # Squares of float32 values are exact in float64 and their sum nearly so: the norm
        # rounds to the same float32 whatever the order of the sum, i.e. however the
        # tensors are sharded. A layout-dependent gradient norm would clip by a slightly
        # different factor and make runs of two layouts drift apart.
        # One foreach kernel per group (on GPU not one launch per tensor); bitwise equal to a
        # per-tensor ``vector_norm(..., dtype=float64)`` for plain tensors and DTensors.
        per_tensor = torch._foreach_norm(group, 2, dtype=torch.float64)
        norm = torch.linalg.vector_norm(torch.stack(per_tensor))
        # A DTensor norm is partial over its shards: reduce to the full value on every rank.
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = (
        torch.linalg.vector_norm(torch.stack(norms))
        if norms
        else torch.zeros((), dtype=torch.float64)
    )
    if pp_mesh is not None and pp_mesh.size() > 1:
        squared = total**2
        dist.all_reduce(squared, group=pp_mesh.get_group())
        total = squared.sqrt()
    return total.float()


def fake_collectives() -> bool:
    """Whether collectives run on the ``fake`` process group (``COMM_MODE=fake_backend`` or
    ``local_tensor``): they return at once, so nothing can hang or be received from rank 0."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def values_are_real() -> bool:
    """False for a ``COMM_MODE=fake_backend`` dry run, where collectives move no data and
    every value computed from them (gradient norms, losses) is meaningless. Under
    ``local_tensor`` the fake group only names ranks and the values are real."""
    return not fake_collectives() or local_tensor.is_simulating()


def init_model_weights(
    model_parts: Sequence[nn.Module],
    build_full: Callable[[], nn.Module],
    *,
    seed: int,
    device: torch.device,
    stage_indices: Sequence[int] | None = None,
    after_init: Callable[[nn.Module], None] | None = None,
) -> None:
    """Materialise the model parts (built on meta, parallelized) on ``device`` with the values
    a one-process run initialises with ``seed``: on CPU and in simulations the initial weights
    depend only on the seed and the flavor, never on the parallelism. On accelerators DTensor's
    generator gives FSDP and TP shards their slices of one initialisation, but pipeline stages
    (``stage_indices``: each part's) cannot replay the draws of the stages before them: stage
    ``i`` draws from ``seed + i`` (every stage restarting ``seed`` would give the blocks of
    different stages identical weights). ``after_init(part)`` initialises what the model's own
    ``init_weights`` does not know (LoRA adapters), from the same random stream."""
    if local_tensor.is_simulating():  # every simulated rank cuts its shards of one init
        with local_tensor.host_only():
            full = build_full_init(build_full, seed, after_init)
        for part in model_parts:
            local_tensor.load_full_model_(part, full)
        return
    for i, part in enumerate(model_parts):
        part.to_empty(device=device)
        torch.manual_seed(seed + (stage_indices[i] if stage_indices else 0))
        with torch.no_grad():
            part.init_weights(buffer_device=device)
            if after_init is not None:
                after_init(part)
    narrow = any(
        p.is_floating_point() and p.dtype != torch.float32
        for part in model_parts
        for p in part.parameters()
    )
    if device.type == "cpu" and not fake_collectives() and (dist.is_initialized() or narrow):
        # DTensor random ops on CPU draw the same numbers on every shard (no offset-based
        # RNG as on CUDA), which would duplicate heads and hidden units. Use the values a
        # one-process init gives instead: every rank builds them and takes its part. bf16
        # parameters (--training.dtype) take them too, cast: drawn in float32, as in every
        # layout, rather than in bf16 in place.
        load_full_init(model_parts, build_full, seed, after_init)


def load_full_init(
    model_parts: Sequence[nn.Module],
    build_full: Callable[[], nn.Module],
    seed: int,
    after_init: Callable[[nn.Module], None] | None = None,
) -> None:
    """Overwrite parallelized model parts with a one-process initialisation.

    Every rank builds the full model on the host with ``seed`` (the same values everywhere)
    and each part keeps its own parameters, cut into its placements (``set_model_state_dict``
    with a full state dict). Works for any split and sharding, pipeline stages included; meant
    for small models (CPU runs): the full model must fit in each rank's host memory.
    """
    full_state = build_full_init(build_full, seed, after_init).state_dict()
    # A part (pipeline stage) takes its own names from the whole model's state.
    options = StateDictOptions(full_state_dict=True, strict=False)
    for part in model_parts:
        set_model_state_dict(part, full_state, options=options)


def build_full_init(
    build_full: Callable[[], nn.Module],
    seed: int,
    after_init: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """The whole model on the host, initialised as one process would with ``seed``."""
    # Built like the trainer builds: on meta (module constructors draw no random numbers).
    with torch.device("meta"):
        full = build_full()
    full.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        full.init_weights(buffer_device=torch.device("cpu"))
        if after_init is not None:
            after_init(full)
    return full


def set_pg_timeouts(seconds: float) -> None:
    """Give every process group this collective timeout (from the second step on)."""
    if not dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=seconds)
    groups = [dist.group.WORLD, *dist.distributed_c10d._world.pg_map]
    for group in dict.fromkeys(groups):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def lost_peer(error: BaseException) -> str | None:
    """The backend's own words when ``error`` (or what it was raised from) says that another
    rank went away mid-collective, e.g. ``Connection closed by peer [127.0.0.1]:42693``;
    ``None`` for any other error.

    Only errors of the backends count: torch's ``DistError`` family (NCCL, the store) and gloo's
    (a plain ``RuntimeError`` whose first line names its source under ``gloo/``), read on their
    first line. A dataloader worker's network error re-raised as a ``RuntimeError`` holds the
    same words deeper in its text, and an ``OSError`` (``BrokenPipeError``) is this process's
    own pipe: both keep their tracebacks."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).strip()
        first = text.splitlines()[0] if text else ""
        # gloo names its source first: "[.../gloo/transport/tcp/pair.cc:553] Connection
        # closed by peer [addr]:port. This is typically caused by ...", after "Gloo
        # connectFullMesh failed with " when the peer went away while the group was made.
        source, _, words = first.partition("] ")
        gloo = isinstance(error, RuntimeError) and "/gloo/" in source and "[" in source
        backend = isinstance(error, dist.DistError) or (
            gloo and (source.startswith("[") or source.startswith("Gloo "))
        )
        if backend and any(marker in first for marker in LOST_PEER_MARKERS):
            if gloo:
                first = words  # the backend's words without the source path
            return first.split(". ")[0].rstrip(".")
        error = error.__cause__ or error.__context__
    return None


def shutdown() -> None:
    """Destroy the process group once every rank is done."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

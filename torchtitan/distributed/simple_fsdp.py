"""Data parallelism as DTensor-parametrized parameters ("SimpleFSDP"): no hooks, no storage.

Each parameter is stored as a DTensor sharded over the data-parallel mesh; with tensor
parallelism it lives on the joint ``(dp..., tp)`` mesh, its TP placement kept on the ``tp``
dimension. Reading ``module.<name>`` gathers it over dp (``redistribute`` to Replicate: an
all-gather) and hands the module the tensor it had before: a plain tensor, or a DTensor on the
TP mesh. Autograd turns the all-gather into a reduce-scatter of the gradient, **averaged** over
the dp ranks as FSDP2 does, so the trainer's loss scaling is the same for both.

It is plain DTensor redistribution, so it runs anywhere DTensor runs: real multi-process runs
(gloo, NCCL) and the single-process simulation ``LocalTensorMode``, where FSDP2's
``fully_shard`` fails (it frees unsharded storage with ``resize_``). The price: parameters are
gathered one at a time when a module reads them (no bucketing, no prefetch), and gathered
copies live until backward uses them (no reshard after forward).

Placements of a parameter (stored on ``(dp_shard,)`` or ``(dp_shard, tp)``) -> what the module
reads, by its placement after tensor parallelism:

- plain tensor, no TP: ``(Shard(0),)`` -> plain tensor;
- plain tensor, TP on: ``(Shard(0), Replicate())`` -> plain tensor;
- TP ``Shard(0)`` (colwise, embedding rows): ``(Shard(1), Shard(0))`` -> DTensor ``(Shard(0),)``;
- TP ``Shard(1)`` (rowwise): ``(Shard(0), Shard(1))`` -> DTensor ``(Shard(1),)``;
- TP ``Replicate()`` (sequence-parallel norms): ``(Shard(0), Replicate())`` -> DTensor
  ``(Replicate(),)``.

FSDP shards a tensor dim other than TP's, so no ``_StridedShard`` is needed: a rank holds the
block ``(dp coordinate along the FSDP dim) x (tp coordinate along the TP dim)``. With a 2-D
``(dp_replicate, dp_shard)`` mesh (HSDP) the dp placements are ``(Replicate(), Shard(d))``.
"""

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from torchtitan.distributed.parallel_dims import ParallelDims

_ACTIVE_ATTR = "_simple_fsdp_gather"


class _GatherOverDP(nn.Module):
    """Sharded DTensor on ``(dp..., [tp])`` -> what the module computes with.

    Forward all-gathers over the dp dims; backward reduce-scatters (or, for the replicate dims
    of HSDP, all-reduces) the gradient with ``avg``.
    """

    def __init__(
        self,
        *,
        dp_ndim: int,
        tp_mesh: DeviceMesh | None,
        tp_placement: Placement | None,
        tp_shape: torch.Size | None,
        tp_stride: tuple[int, ...] | None,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ):
        super().__init__()
        self.tp_mesh = tp_mesh
        self.tp_placement = tp_placement
        self.tp_shape = tp_shape
        self.tp_stride = tp_stride
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        tp_dims = () if tp_mesh is None else (tp_placement or Replicate(),)
        self.compute_placements = (Replicate(),) * dp_ndim + tp_dims
        self.grad_placements = (Partial("avg"),) * dp_ndim + tp_dims

    def forward(self, sharded: DTensor) -> torch.Tensor:
        gathered = sharded.redistribute(
            placements=self.compute_placements,
            forward_dtype=self.param_dtype,
            backward_dtype=self.reduce_dtype,
        )
        local = gathered.to_local(grad_placements=self.grad_placements)
        if self.tp_placement is None:
            return local
        return DTensor.from_local(
            local,
            self.tp_mesh,
            (self.tp_placement,),
            run_check=False,
            shape=self.tp_shape,
            stride=self.tp_stride,
        )


PARAMETRIZATIONS = (_GatherOverDP,)
"""The modules that compute a parameter (the gather over data-parallel ranks), not the model:
what a walk over a model's modules may skip."""


def _fsdp_dim(param: torch.Tensor, tp_placement: Placement | None) -> int | None:
    """The tensor dim FSDP shards: 0, or 1 when TP already shards dim 0; ``None`` (kept whole
    over dp, its gradient all-reduced) for a 1-D parameter TP splits: a column-parallel
    projection's bias, per-head attention sinks (a few values per rank)."""
    if isinstance(tp_placement, Shard) and tp_placement.dim % param.ndim == 0:
        return 1 if param.ndim >= 2 else None
    return 0


def _joint_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> DeviceMesh:
    if tp_mesh is None:
        return dp_mesh
    # torch has no public way to join two slices of one root mesh into a 2-D mesh.
    return DeviceMesh._concatenate([dp_mesh, tp_mesh])


def _shard(
    param: nn.Parameter, mesh: DeviceMesh, dp_placements: tuple[Placement, ...], tp_p
) -> nn.Parameter:
    """``param`` (plain, or a DTensor on the TP mesh) -> DTensor on ``mesh``, dp-sharded.

    Only splits local data (Replicate -> Shard over dp): no communication, works on meta.
    """
    tp_dims = () if mesh.ndim == len(dp_placements) else (tp_p or Replicate(),)
    local = param.to_local() if isinstance(param, DTensor) else param
    replicated = DTensor.from_local(
        local.detach(),
        mesh,
        (Replicate(),) * len(dp_placements) + tp_dims,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    sharded = replicated.redistribute(mesh, dp_placements + tp_dims)
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def apply_simple_fsdp(
    model: nn.Module,
    *,
    dp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard every parameter of ``model`` over ``dp_mesh`` (1-D: FSDP; ``(replicate, shard)``:
    HSDP) and gather it whenever a module reads it. Apply after tensor parallelism.

    Parameters that TP made DTensors must live on ``tp_mesh``; ``tp_mesh`` and ``dp_mesh`` are
    slices of the same world mesh. State-dict keys do not change (the sharded DTensor stays in
    ``module._parameters``); build the optimizer afterwards. ``param_dtype`` casts before the
    all-gather, ``reduce_dtype`` the gradient before its reduce-scatter (``None``: no cast).

    Initialise weights with :func:`sharded_access` active (or by replacing the DTensors),
    since inside it ``module.<name>`` is the stored DTensor rather than a gathered copy.
    Modules already wrapped (e.g. routed experts, over their own ``efsdp`` and ``ep`` meshes
    first) are left as they are.
    """
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(f"dp_mesh must be 1-D (FSDP) or 2-D (HSDP), got {dp_mesh}")
    mesh = _joint_mesh(dp_mesh, tp_mesh)
    done: dict[int, nn.Parameter] = {}
    for module_name, module in list(model.named_modules()):
        names = [n for n, p in module.named_parameters(recurse=False) if p is not None]
        if not names or hasattr(module, "_simple_fsdp_parametrizations"):
            continue
        parametrizations: dict[str, _GatherOverDP] = {}
        for name in names:
            param = module._parameters[name]
            full_name = f"{module_name}.{name}" if module_name else name
            tp_p = None
            if isinstance(param, DTensor):
                if tp_mesh is None or param.device_mesh != tp_mesh:
                    raise ValueError(
                        f"{full_name} is a DTensor on {param.device_mesh}; apply_simple_fsdp "
                        f"expects plain parameters or DTensors on tp_mesh={tp_mesh}"
                    )
                (tp_p,) = param.placements
            dim = _fsdp_dim(param, tp_p)
            dp_placements = (Replicate(),) * (dp_mesh.ndim - 1) + (
                Replicate() if dim is None else Shard(dim),
            )
            if id(param) not in done:  # tied weights are sharded once, shared afterwards
                done[id(param)] = _shard(param, mesh, dp_placements, tp_p)
            module._parameters[name] = done[id(param)]
            parametrizations[name] = _GatherOverDP(
                dp_ndim=dp_mesh.ndim,
                tp_mesh=tp_mesh,
                tp_placement=tp_p,
                tp_shape=param.shape if tp_p is not None else None,
                tp_stride=param.stride() if tp_p is not None else None,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
            )
        _register_gather(module, parametrizations)
    return model


def _register_gather(module: nn.Module, parametrizations: dict[str, _GatherOverDP]) -> None:
    """Make ``module.<name>`` return the gathered parameter, like ``torch.nn.utils.parametrize``
    but without moving the parameter to ``parametrizations.<name>.original``: state dicts,
    checkpoints and optimizers keep seeing the stored (sharded) DTensor under its own name.
    """

    def getter(name: str):
        def get(self: nn.Module) -> torch.Tensor:
            stored = self._parameters[name]
            if not getattr(self, _ACTIVE_ATTR, True):
                return stored
            return self._simple_fsdp_parametrizations[name](stored)

        return property(get)

    cls = module.__class__
    module.__class__ = type(
        f"SimpleFSDP{cls.__name__}", (cls,), {n: getter(n) for n in parametrizations}
    )
    # A ModuleDict so the parametrizations follow ``model.to(...)`` and show in ``print``.
    module._simple_fsdp_parametrizations = nn.ModuleDict(parametrizations)


@contextlib.contextmanager
def sharded_access(model: nn.Module) -> Iterator[None]:
    """Inside, ``module.<name>`` returns the stored (sharded) DTensor instead of gathering it,
    e.g. for ``init_weights`` to write into the shards. (On CPU, DTensor random ops draw the
    same numbers on every shard, also under ``LocalTensorMode``: load a one-process
    initialisation there instead.)"""
    modules = [m for m in model.modules() if hasattr(m, "_simple_fsdp_parametrizations")]
    for m in modules:
        object.__setattr__(m, _ACTIVE_ATTR, False)
    try:
        yield
    finally:
        for m in modules:
            object.__setattr__(m, _ACTIVE_ATTR, True)


def apply_simple_fsdp_over(
    model: nn.Module, dims: "ParallelDims", mp_policy: "MixedPrecisionPolicy"
) -> nn.Module:
    """:func:`apply_simple_fsdp` over the run's data-parallel mesh (and TP mesh), in the
    precision of FSDP's policy."""
    return apply_simple_fsdp(
        model,
        dp_mesh=dims.data_parallel_mesh(),
        tp_mesh=dims.mesh("tp") if dims.tp_enabled else None,
        param_dtype=mp_policy.param_dtype,
        reduce_dtype=mp_policy.reduce_dtype,
    )

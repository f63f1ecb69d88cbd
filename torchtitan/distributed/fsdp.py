"""Data parallelism on FSDP2: sharded (FSDP), hybrid (HSDP) and replicated (DDP-style).

All three go through ``torch.distributed.fsdp`` so they share one behaviour: they can be
applied on the meta device, parameters become DTensors, and gradients arrive already averaged
over the data-parallel ranks. Apply per block, then on the root, so each block's parameters
are gathered (and its gradients reduced) on their own while neighbours compute.
"""

import inspect
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

from torchtitan.distributed import precision

try:
    from torch.distributed._composable.replicate_with_fsdp import replicate as _replicate
except ImportError:  # pragma: no cover - older torch
    _replicate = None


def mixed_precision_policy(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=precision.DTYPES[param_dtype], reduce_dtype=precision.DTYPES[reduce_dtype]
    )


def _offload_policy(cpu_offload: bool) -> OffloadPolicy:
    # Pinned memory needs an accelerator; plain host memory works everywhere.
    return (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )


def _reshards(mode: str, *, last: bool) -> bool:
    """``reshard_after_forward`` of one unit: the last block's parameters are needed again
    right away by backward, so ``default`` keeps them."""
    return mode == "always" or (mode == "default" and not last)


def apply_fsdp(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: Literal["default", "always", "never"] = "default",
    cpu_offload: bool = False,
    prefetch: int = 0,
    inner_units: Sequence[Sequence[nn.Module]] = (),
) -> nn.Module:
    """Shard ``blocks`` then ``model`` over ``mesh`` (1D: FSDP; 2D replicate x shard: HSDP).
    ``prefetch`` >= 1: each block starts the all-gathers of the next ``prefetch`` blocks (in
    forward order, and in reverse order in backward), with their ``inner_units`` (per block,
    the units sharded separately inside it, in forward order: e.g. MoE experts), which an
    explicit prefetch list would otherwise leave to be gathered only when they start."""
    offload = _offload_policy(cpu_offload)
    blocks = list(blocks)
    for i, block in enumerate(blocks):
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload,
            reshard_after_forward=_reshards(reshard_after_forward, last=i == len(blocks) - 1),
        )
    fully_shard(
        model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=False
    )
    if prefetch > 0:
        inner = list(inner_units) or [()] * len(blocks)
        units = [[block, *inside] for block, inside in zip(blocks, inner, strict=True)]
        for i, block in enumerate(blocks):
            ahead = units[i + 1 : i + 1 + prefetch]
            behind = units[max(0, i - prefetch) : i][::-1]
            block.set_modules_to_forward_prefetch([u for group in ahead for u in group])
            block.set_modules_to_backward_prefetch([u for group in behind for u in group[::-1]])
    return model


def apply_fsdp_experts(
    experts: Iterable[nn.Module],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: Literal["default", "always", "never"] = "default",
    cpu_offload: bool = False,
) -> None:
    """Shard mixture-of-experts weights over ``mesh`` (the data-parallel ranks expert
    parallelism leaves; their weights may already be DTensors over ``ep`` or ``tp``), each
    module its own unit, in block order, before its block is sharded: the same resharding and
    offload rules as :func:`apply_fsdp`. Each weight is split along the experts where this
    rank's experts divide evenly over ``mesh``, else along a width that does
    (:func:`expert_shard_dim`)."""
    experts = list(experts)
    ranks = mesh.size(mesh.ndim - 1)  # (HSDP: the sharding dim)
    for i, module in enumerate(experts):
        fully_shard(
            module,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=_offload_policy(cpu_offload),
            reshard_after_forward=_reshards(reshard_after_forward, last=i == len(experts) - 1),
            shard_placement_fn=lambda param: Shard(expert_shard_dim(param, ranks)),
        )


def expert_shard_dim(param: torch.Tensor, ranks: int) -> int:
    """The dim FSDP splits an expert weight ``[experts, ...]`` along over ``ranks``: the
    experts (dim 0) where this rank's count divides evenly, else the first other dim that
    divides and that tensor or expert parallelism does not already split. FSDP pads an uneven
    dim 0, so 2 experts over 8 ranks would hold a whole expert on each: 4x the weights (Llama 4
    Scout, 16 experts under EP 8 over 64 ranks: 23 GiB of parameters per rank instead of 6)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.shape[0] % ranks == 0:
        return 0
    taken = {p.dim for p in param.placements if isinstance(p, Shard)} if isinstance(
        param, DTensor
    ) else set()  # fmt: skip
    for dim in range(1, local.ndim):
        if dim not in taken and local.shape[dim] % ranks == 0:
            return dim
    return 0


def apply_replicate(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
) -> nn.Module:
    """DDP-style data parallelism: full copies, gradients all-reduced per block."""
    if _replicate is None:
        raise RuntimeError(
            "this torch has no torch.distributed._composable.replicate_with_fsdp; use "
            "--parallelism.data_parallel_shard_degree instead of data_parallel_replicate_degree"
        )
    mesh_kw = "mesh" if "mesh" in inspect.signature(_replicate).parameters else "device_mesh"
    for block in blocks:
        _replicate(block, mp_policy=mp_policy, **{mesh_kw: mesh})
    _replicate(model, mp_policy=mp_policy, **{mesh_kw: mesh})
    return model

"""Muon (``--optimizer.name Muon``): momentum SGD whose update for each weight matrix is
orthogonalised by a Newton-Schulz iteration, used for the matrices inside the transformer
blocks; embeddings, the output projection and every vector train with AdamW
(:func:`muon_takes`).

Sharded parameters (FSDP, TP, EP: DTensors) are orthogonalised whole, each matrix by one rank
(:func:`orthogonalise_updates`): the updates of same-shaped matrices (the same projection of
every block) are stacked, the stack is redistributed so that each rank of the mesh dimensions
that split the matrices holds a share of whole matrices (an all-to-all on CUDA; an all-gather
and a local cut on gloo, which has no DTensor all-to-all), each rank runs the iteration on its
share, and the results go back to the parameters' placements. Every layout so computes the
one-process update while the iteration is split among the ranks. A matrix whose placements
leave its two dimensions whole (EP's experts, split only along the experts) is orthogonalised
where it lies, with no collective. MoE experts' ``[experts, in, out]`` weights are orthogonalised
per expert.
"""

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# Quintic Newton-Schulz coefficients (Keller Jordan's), tuned to drive singular values toward
# 1 in few steps rather than to converge exactly.
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def muon_takes(name: str, param: torch.Tensor) -> bool:
    """Whether Muon trains ``param`` (its wrapper-free name): a matrix (or a stack of expert
    matrices) inside the transformer blocks. The rest (embeddings, output, norms, biases,
    stacked per expert too) takes AdamW."""
    return param.ndim in (2, 3) and name.startswith("layers.") and not name.endswith("bias")


def orthogonalise(
    update: torch.Tensor, steps: int, eps: float = 1e-7, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Newton-Schulz approximation of ``U V^T`` for ``update = U S V^T`` (per matrix of the
    last two dimensions), computed and returned in ``dtype``."""
    x = update.to(dtype)
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    a, b, c = _NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transposed else x


class Muon(torch.optim.Optimizer):
    """Muon over matrices (2-D, or 3-D stacks orthogonalised per matrix). The learning rate is
    scaled by ``0.2 * sqrt(max(rows, columns))`` so that updates have AdamW's typical RMS and
    one ``--optimizer.lr`` serves both optimizers (Moonlight's rule); weight decay is
    decoupled, as AdamW's."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
    ):
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps,
        )  # fmt: skip
        # Not a param-group setting: a checkpoint's groups would otherwise carry it back.
        self.ns_dtype = ns_dtype
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon trains matrices; got a parameter of shape {p.shape}")

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, updates = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(p.grad)
                params.append(p)
                updates.append(
                    p.grad.add(buffer, alpha=group["momentum"]) if group["nesterov"] else buffer
                )
            orthos = orthogonalise_updates(updates, group["ns_steps"], self.ns_dtype)
            for p, ortho in zip(params, orthos, strict=True):
                rows, columns = p.shape[-2:]
                lr = group["lr"] * 0.2 * math.sqrt(max(rows, columns))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(ortho, alpha=-lr)
        return loss


def orthogonalise_updates(
    updates: list[torch.Tensor], steps: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """:func:`orthogonalise` of each update (iterating in ``dtype``), returned in the update's
    dtype and placements.

    Plain tensors, and DTensors whose placements keep the matrices whole, are orthogonalised
    where they lie. The others are grouped by mesh, placements and shape, in the order given
    (the same on every rank), and each group is cut into stacks of as many matrices as there
    are ranks splitting them: every rank orthogonalises one matrix of each stack.
    """
    updates = list(updates)
    out: list[torch.Tensor | None] = [None] * len(updates)
    stacks: dict[tuple, list[int]] = {}
    for i, update in enumerate(updates):
        if isinstance(update, DTensor) and any(p.is_partial() for p in update.placements):
            update = updates[i] = update.redistribute(
                placements=[Replicate() if p.is_partial() else p for p in update.placements]
            )
        if not isinstance(update, DTensor):
            out[i] = orthogonalise(update, steps, dtype=dtype).to(update.dtype)
        elif not _ranks_splitting_matrices(update):
            local = orthogonalise(update.to_local(), steps, dtype=dtype).to(update.dtype)
            out[i] = _from_local(local, update)
        else:
            key = (update.device_mesh, tuple(update.placements), update.shape, update.dtype)
            stacks.setdefault(key, []).append(i)
    for indices in stacks.values():
        share = math.prod(_ranks_splitting_matrices(updates[indices[0]]).values())
        for start in range(0, len(indices), share):
            batch = indices[start : start + share]
            orthos = _orthogonalise_stack([updates[i] for i in batch], share, steps, dtype)
            for i, ortho in zip(batch, orthos, strict=True):
                out[i] = ortho
    return out  # type: ignore[return-value]  (every index is filled above)


def _orthogonalise_stack(
    updates: list[DTensor], share: int, steps: int, dtype: torch.dtype
) -> list[DTensor]:
    """Updates of one mesh, placements and shape (at most ``share``, the ranks splitting each),
    stacked along a new first dimension and spread so that each rank holds whole matrices of
    the stack (the mesh dimensions that split a matrix split the stack instead; the others keep
    their placement), orthogonalised there and returned to their placements."""
    first, count = updates[0], len(updates)
    if enabled_local_tensor_mode() is not None:
        # Simulated ranks (COMM_MODE=local_tensor): a stack of fewer matrices than ranks gives
        # the ranks shares of different sizes, which torch 2.11's LocalTensor cannot multiply.
        # Zero matrices fill it (they orthogonalise to zero and are dropped).
        updates = updates + [torch.zeros_like(first)] * (share - count)
    mesh, placements = first.device_mesh, first.placements
    stacked = [_shifted(p) for p in placements]
    splitting = _ranks_splitting_matrices(first)
    spread = [Shard(0) if d in splitting else p for d, p in enumerate(stacked)]
    shape = torch.Size((len(updates), *first.shape))
    stride = torch.empty(shape, device="meta").stride()
    local = torch.stack([u.to_local() for u in updates])
    stack = DTensor.from_local(local, mesh, stacked, run_check=False, shape=shape, stride=stride)
    mine = stack.redistribute(mesh, spread).to_local()
    ortho = orthogonalise(mine, steps, dtype=dtype).to(first.dtype)
    ortho = DTensor.from_local(ortho, mesh, spread, run_check=False, shape=shape, stride=stride)
    back = ortho.redistribute(mesh, stacked).to_local()
    return [_from_local(t, first) for t in back.unbind(0)[:count]]


def _ranks_splitting_matrices(t: DTensor) -> dict[int, int]:
    """The mesh dimensions (of more than one rank) whose placement splits one of the last two
    (matrix) dimensions of ``t``, with their sizes."""
    matrix_dims = {t.ndim - 2, t.ndim - 1}
    return {
        d: t.device_mesh.size(d)
        for d, p in enumerate(t.placements)
        if isinstance(p, (Shard, _StridedShard))
        and p.dim % t.ndim in matrix_dims
        and t.device_mesh.size(d) > 1
    }


def _shifted(p: Placement) -> Placement:
    """``p`` for the same tensor with a new first dimension in front."""
    if isinstance(p, _StridedShard):  # before Shard: a subclass of it in torch 2.11
        return _StridedShard(p.dim + 1, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return Shard(p.dim + 1)
    return p


def _from_local(local: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's ``local`` shard as a DTensor placed as ``like`` is."""
    return DTensor.from_local(
        local.contiguous(), like.device_mesh, like.placements, run_check=False,
        shape=like.shape, stride=like.stride(),
    )  # fmt: skip

"""Muon (``--optimizer.name Muon``): momentum SGD whose update for each weight matrix is
orthogonalised by a Newton-Schulz iteration, used for the matrices inside the transformer
blocks; embeddings, the output projection and every vector train with AdamW
(:func:`muon_takes`).

Sharded parameters (FSDP, TP, EP: DTensors) are orthogonalised whole, each matrix by one rank
(:func:`orthogonalised`). The updates of same-shaped matrices (the same projection of every
block) are stacked; the stack is redistributed so that each rank of the mesh dimensions that
split the matrices holds a share of whole matrices (DTensor's plan: an all-to-all on CUDA where
one mesh dimension splits them; all-gathers along a mesh dimension on gloo, and for some
layouts split by two); each rank runs the iteration on its share, and the results go back to
the parameters' placements. Every layout so computes the one-process update while the
iteration is split among the ranks. A matrix whose placements leave its two dimensions whole
(EP's experts, split only along the experts) is orthogonalised where it lies, with no
collective. MoE experts' ``[experts, in, out]`` weights are orthogonalised per expert.
"""

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.torch_version import TorchVersion

from torchtitan.components.stochastic_rounding import Rounding, closure_loss, local, placed_as

# torch 2.11's LocalTensor cannot multiply tensors whose shapes differ between simulated ranks.
_PAD_SIMULATED_STACKS = TorchVersion(torch.__version__) < (2, 13)

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
        rounding: Rounding | None = None,
    ):
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps,
        )  # fmt: skip
        # Not a param-group setting: a checkpoint's groups would otherwise carry it back.
        self.ns_dtype = ns_dtype
        # Stochastic rounding of bf16 weights (--optimizer.stochastic_rounding), or None.
        self.rounding = rounding
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon trains matrices; got a parameter of shape {p.shape}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("ns_dtype", torch.float32)  # torch's pickling leaves it out
        self.__dict__.setdefault("rounding", None)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = closure_loss(closure)
        for group in self.param_groups:

            def update_of(p: torch.Tensor, group: dict = group) -> torch.Tensor:
                """The momentum update of ``p`` (Nesterov's by default), made when its
                orthogonalisation needs it (so only those of one stack live at a time)."""
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                grad = placed_as(p.grad, p)
                buffer.mul_(group["momentum"]).add_(grad)
                if not group["nesterov"]:
                    return buffer
                return grad.add(buffer, alpha=group["momentum"])

            params = [p for p in group["params"] if p.grad is not None]
            for p, ortho in orthogonalised(params, update_of, group["ns_steps"], self.ns_dtype):
                rows, columns = p.shape[-2:]
                lr = group["lr"] * 0.2 * math.sqrt(max(rows, columns))
                decay = 1 - group["lr"] * group["weight_decay"]
                if self.rounding is None:
                    p.mul_(decay)
                    p.add_(ortho, alpha=-lr)
                    continue
                weight = local(p).float().mul_(decay)
                weight.add_(local(placed_as(ortho, p)).float(), alpha=-lr)
                self.rounding.round_into_(p, weight.contiguous())
        return loss


def orthogonalised(
    params: list[torch.Tensor],
    update_of: Callable[[torch.Tensor], torch.Tensor],
    steps: int,
    dtype: torch.dtype = torch.float32,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(param, orthogonalised update)`` for each of ``params``, the update
    (``update_of(param)``) orthogonalised by :func:`orthogonalise` in ``dtype`` and returned in
    the parameter's dtype and placements, each as soon as it is ready.

    Plain tensors, and DTensors whose placements keep the matrices whole, are orthogonalised
    where they lie. The others are grouped by mesh, placements, shape and dtype, in the order
    given (the same on every rank: the collectives follow it), and each group is cut into
    stacks of as many matrices as there are ranks splitting them; every rank orthogonalises
    one matrix of each stack.
    """
    stacks: dict[tuple, list[DTensor]] = {}
    for p in params:
        if isinstance(p, DTensor) and _ranks_splitting_matrices(p):
            key = (p.device_mesh, tuple(p.placements), p.shape, p.dtype)
            stacks.setdefault(key, []).append(p)
            continue
        update = update_of(p)
        mine = local(update)
        ortho = orthogonalise(mine, steps, dtype=dtype).to(p.dtype)
        yield p, (_from_local(ortho, p) if isinstance(p, DTensor) else ortho)
    for members in stacks.values():
        share = math.prod(_ranks_splitting_matrices(members[0]).values())
        for start in range(0, len(members), share):
            batch = members[start : start + share]
            updates = [update_of(p) for p in batch]
            yield from zip(batch, _orthogonalise_stack(updates, share, steps, dtype), strict=True)


def _orthogonalise_stack(
    updates: list[DTensor], share: int, steps: int, dtype: torch.dtype
) -> list[DTensor]:
    """Updates of one mesh, placements and shape (at most ``share``, the ranks splitting each),
    stacked along a new first dimension and spread so that each rank holds whole matrices of
    the stack (the mesh dimensions that split a matrix split the stack instead; the others keep
    their placement), orthogonalised there and returned to their placements."""
    first, count = updates[0], len(updates)
    if _PAD_SIMULATED_STACKS and enabled_local_tensor_mode() is not None:
        # Simulated ranks (COMM_MODE=local_tensor) on torch < 2.13: a stack of fewer matrices
        # than ranks gives the ranks shares of different sizes, which that LocalTensor cannot
        # multiply. Zero matrices fill it (they orthogonalise to zero and are dropped).
        updates = updates + [torch.zeros_like(first)] * (share - count)
    mesh, placements = first.device_mesh, first.placements
    stacked = [_shifted(p, first.ndim) for p in placements]
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


def _shifted(p: Placement, ndim: int) -> Placement:
    """``p`` (of a tensor of ``ndim`` dimensions) for the same tensor with a new first
    dimension in front."""
    if isinstance(p, _StridedShard):  # before Shard: a subclass of it in torch 2.11
        return _StridedShard(p.dim % ndim + 1, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return Shard(p.dim % ndim + 1)
    return p


def _from_local(local: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's ``local`` shard as a DTensor placed as ``like`` is."""
    return DTensor.from_local(
        local.contiguous(), like.device_mesh, like.placements, run_check=False,
        shape=like.shape, stride=like.stride(),
    )  # fmt: skip

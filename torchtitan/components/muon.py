"""Muon (``--optimizer.name Muon``): momentum SGD whose update for each weight matrix is
orthogonalised by a Newton-Schulz iteration, used for the matrices inside the transformer
blocks; embeddings, the output projection and every vector train with AdamW
(:func:`muon_takes`).

Sharded parameters (FSDP, TP, EP: DTensors) are orthogonalised whole: each rank gathers the
update of the matrix, runs the iteration in float32 on it, and keeps its own shard of the
result. Every rank so computes what one process would from the same gradient, which keeps
layouts equal to one process; the price is a gather of every matrix's update per step and the
iteration repeated on every rank (``docs/training.md`` has the cost). MoE experts' ``[experts,
in, out]`` weights are orthogonalised per expert.
"""

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

# Quintic Newton-Schulz coefficients (Keller Jordan's), tuned to drive singular values toward
# 1 in few steps rather than to converge exactly.
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def muon_takes(name: str, param: torch.Tensor) -> bool:
    """Whether Muon trains ``param`` (its wrapper-free name): a matrix (or a stack of expert
    matrices) inside the transformer blocks. The rest (embeddings, output, norms, biases,
    stacked per expert too) takes AdamW."""
    return param.ndim in (2, 3) and name.startswith("layers.") and not name.endswith("bias")


def orthogonalise(update: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz approximation of ``U V^T`` for ``update = U S V^T`` (per matrix of the
    last two dimensions), in float32."""
    x = update.float()
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
    ):
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps,
        )  # fmt: skip
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
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.mul_(group["momentum"]).add_(p.grad)
                update = (
                    p.grad.add(buffer, alpha=group["momentum"]) if group["nesterov"] else buffer
                )
                ortho = orthogonalise(_whole(update), group["ns_steps"])
                ortho = _like(ortho.to(p.dtype), p)
                rows, columns = p.shape[-2:]
                lr = group["lr"] * 0.2 * math.sqrt(max(rows, columns))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(ortho, alpha=-lr)
        return loss


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (sharded) DTensor, on every rank."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``whole`` placed as ``param`` is: this rank's shard, cut locally (every rank holds the
    same ``whole``, so no collective)."""
    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)

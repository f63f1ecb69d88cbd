"""Ring attention with torch's CPU attention kernel: a shim for torch 2.11 to 2.13.

torch's context parallelism sends SDPA on sequence-sharded DTensors to ring attention only for
the CUDA kernels (flash, efficient, cuDNN). On CPU, SDPA lowers to
``aten._scaled_dot_product_flash_attention_for_cpu``, which has no handler: "does not have a
sharding strategy registered". That kernel returns the float32 log-sum-exp that ring attention
merges partial results with, and its backward op takes it back, so the two handlers here run
torch's own ring attention (``_templated_ring_attention`` and its backward) with the CPU
kernels. Remove this module once torch handles the CPU kernel itself.

Under ``COMM_MODE=local_tensor`` torch's ring loop cannot run: it branches in Python on the
rank, and one process plays every rank. There the handlers compute the same attention another
exact way, with tensor ops only: K/V gathered from the whole ring, each rank's queries masked by
the causal order of their positions (the ring's head-tail layout), and the K/V
gradients reduce-scattered back to their owners.
"""

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import _context_parallel as ring_options
from torch.distributed.tensor.experimental._context_parallel import _attention as ring

from torchtitan.distributed import local_tensor

_aten = torch.ops.aten
_FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_SEQ_DIM = 2  # [bs, heads, seq, head_dim]; the log-sum-exp is [bs, heads, seq]
# Named *_single from torch 2.13 on; the *_tensor names are deprecated there.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def register() -> None:
    """Add the CPU kernel's forward and backward to DTensor's custom handlers (idempotent).
    Call after torch's ``_enable_context_parallel_dispatcher``, which resets that table."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[_FORWARD] = _forward
    handlers[_BACKWARD] = _backward


def _forward_args(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    return query, key, value, dropout_p, is_causal, attn_mask, scale


def _backward_args(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    return grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale


def _check(dropout_p: float, is_causal: bool, attn_mask: torch.Tensor | None) -> None:
    if not is_causal or attn_mask is not None or dropout_p:
        raise NotImplementedError(
            "context parallelism on CPU runs causal attention without a mask or dropout only"
        )


def _forward(op_call, args, kwargs):
    query, key, value, dropout_p, is_causal, attn_mask, scale = _forward_args(*args, **kwargs)
    _check(dropout_p, is_causal, attn_mask)
    mesh = query.device_mesh
    q, k, v = query.to_local(), key.to_local(), value.to_local()
    if local_tensor.is_simulating():
        k, v = _gather(k, mesh), _gather(v, mesh)
        out, lse = _FORWARD(q, k, v, attn_mask=_causal_mask(mesh, q), scale=scale)
    else:
        out, lse = ring._templated_ring_attention(
            mesh.get_group(), _SEQ_DIM, _FORWARD, query=q, key=k, value=v,
            is_causal=True, dropout_p=0.0, scale=scale,
        )  # fmt: skip
    return _sequence_shards(mesh, out, lse)


def _backward(op_call, args, kwargs):
    grad_out, query, key, value, out, lse, dropout_p, is_causal, attn_mask, scale = _backward_args(
        *args, **kwargs
    )
    _check(dropout_p, is_causal, attn_mask)
    mesh = query.device_mesh
    g, q, k, v, o, lse = (t.to_local() for t in (grad_out, query, key, value, out, lse))
    if local_tensor.is_simulating():
        mask = _causal_mask(mesh, q)
        dq, dk, dv = _BACKWARD(
            g, q, _gather(k, mesh), _gather(v, mesh), o, lse, 0.0, False, attn_mask=mask,
            scale=scale,
        )  # fmt: skip
        dk, dv = _scatter_sum(dk, mesh), _scatter_sum(dv, mesh)
    else:
        dq, dk, dv = ring._templated_ring_attention_backward(
            mesh.get_group(), _SEQ_DIM, _BACKWARD, grad_out=g, grad_out_name="grad_out",
            query=q, key=k, value=v, out=o, logsumexp=lse, is_causal=True, dropout_p=0.0,
            scale=scale,
        )  # fmt: skip
    return _sequence_shards(mesh, dq, dk, dv)


def _sequence_shards(mesh: DeviceMesh, *tensors: torch.Tensor) -> tuple[DTensor, ...]:
    return tuple(DTensor.from_local(t, mesh, [Shard(_SEQ_DIM)], run_check=False) for t in tensors)


def _gather(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return funcol.wait_tensor(_all_gather(t.contiguous(), _SEQ_DIM, mesh.get_group()))


def _scatter_sum(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return funcol.wait_tensor(_reduce_scatter(t.contiguous(), "sum", _SEQ_DIM, mesh.get_group()))


def _causal_mask(mesh: DeviceMesh, q: torch.Tensor) -> torch.Tensor:
    """``[local seq, seq]`` additive mask: a rank's query at position p sees keys at <= p, the
    keys ordered as gathered (rank after rank, each rank's positions in the ring's layout)."""
    cp, local = mesh.size(), q.shape[_SEQ_DIM]
    if ring_options._cp_options.enable_load_balance:
        # torch's layout for its ring attention (``context_parallel.sequence_order`` is ours:
        # the tests see them agree).
        balancer = ring_options._HeadTailLoadBalancer(local * cp, cp, torch.device("cpu"))
        order = balancer._generate_indices()[0]
    else:
        order = torch.arange(local * cp)

    def mask(rank: int) -> torch.Tensor:
        seen = order[rank * local : (rank + 1) * local, None] >= order[None, :]
        return torch.zeros(seen.shape, dtype=q.dtype).masked_fill_(~seen, float("-inf"))

    return local_tensor.for_each_coordinate(mask, mesh.get_local_rank())

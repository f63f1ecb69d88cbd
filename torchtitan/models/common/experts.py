"""The routed experts of the shared MoE layer (``moe.py``): ``E`` gated experts in three stacked
weights, computed on rows sorted by expert, as one matmul chain per expert (the reference) or
as three grouped GEMMs; the experts' gating (SwiGLU, gpt-oss's clamped SwiGLU).

Expert parallelism (``distributed/expert_parallel.py``) hooks :class:`GroupedExperts` to
exchange the rows; tensor parallelism without it splits every expert's hidden width.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import DTensor

from torchtitan.distributed.tensor_parallel import sum_gradients
from torchtitan.models.common.moe_args import MoEArgs

ALIGN_ROWS = 16
"""Each expert's rows start at a multiple of this in the grouped GEMM's input (CUDA's grouped
kernels need aligned group starts; zero rows pad the groups)."""


def no_values(t: torch.Tensor) -> bool:
    """Fake or meta tensors: shapes without values."""
    return isinstance(t, FakeTensor) or t.device.type == "meta"


class GroupedExperts(nn.Module):
    """``E`` gated experts (SwiGLU, or ``MoEArgs.activation``): ``x [N, dim]``, rows sorted by
    expert, ``counts [E]`` rows each -> ``[N, dim]``. Weights ``w1, w3 [E, hidden, dim]`` and
    ``w2 [E, dim, hidden]`` (per expert the layout of ``nn.Linear``), with ``bias`` their
    biases ``w1_bias, w3_bias [E, hidden]`` and ``w2_bias [E, dim]``. Under expert parallelism
    the parameters are DTensors sharded over the experts and hooks exchange the rows, so ``E``
    here is this rank's share; under tensor parallelism without it they are sharded along
    ``hidden`` (``MoE.hidden_split_mesh``; ``w2_bias`` whole, see ``partial_output_mesh``).
    Either way the forward computes with the local shards."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        impl: str = "auto",
        *,
        bias: bool = False,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        self.impl = impl
        self.activation = activation or _swiglu
        self.weight_grad_scale = 1.0
        """Multiplies the parameters' gradients (expert parallelism sets ``1 / ep``: an
        expert's gradient sums the tokens of all ``ep`` ranks, data-parallel averaging
        divides only by the ranks that hold the same experts)."""
        self.partial_output_mesh = None
        """Set by a tensor-parallel plan that splits the hidden width over its ranks: each
        returns a partial sum of the output, so ``w2_bias`` (whole on every rank) counts for
        ``1 / ranks`` on each, and its gradient is summed over them."""
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.has_bias = bias
        if bias:
            self.w1_bias = nn.Parameter(torch.empty(num_experts, hidden))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, dim))
            self.w3_bias = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        names = ("w1", "w2", "w3") + (("w1_bias", "w2_bias", "w3_bias") if self.has_bias else ())
        params = [getattr(self, name) for name in names]
        params = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        if self.weight_grad_scale != 1.0:
            params = [ScaleGradient.apply(p, self.weight_grad_scale) for p in params]
        dtype = _compute_dtype(x)
        x = x.to(dtype)
        params = [p.to(dtype) for p in params]
        weights, biases = params[:3], params[3:] or None
        if biases is not None and self.partial_output_mesh is not None:
            mesh = self.partial_output_mesh
            biases[1] = sum_gradients(biases[1], mesh) / mesh.size()
        act = self.activation
        if no_values(x) and not (dtype == torch.bfloat16 and self.uses_grouped_mm(dtype)):
            # Shapes only (dry runs, pipeline shape inference): the grouped GEMM's meta kernel
            # takes bf16 only and the loop needs values; one expert gives the same shapes.
            w1, w2, w3 = (w[0] for w in weights)
            return act(x @ w1.T, x @ w3.T) @ w2.T
        if self.uses_grouped_mm(dtype):
            return _grouped_mm_experts(x, counts, *weights, biases=biases, activation=act)
        if isinstance(x, LocalTensor):  # the loop reads each simulated rank's own counts
            raise RuntimeError(
                f"COMM_MODE=local_tensor needs the grouped GEMM for the routed experts, which "
                f"cannot run here ({dtype}, widths {tuple(self.w1.shape[1:])}: fp32 or bf16 "
                "with 16-byte aligned widths, bf16 when compiled)"
            )
        return _loop_experts(x, counts, *weights, biases=biases, activation=act)

    def uses_grouped_mm(self, dtype: torch.dtype) -> bool:
        """Whether ``auto`` (or ``grouped_mm``) takes the grouped GEMM for this dtype."""
        if self.impl == "loop":
            return False
        if self.impl == "grouped_mm":
            return True
        # Inner dims must be 16-byte aligned (this rank's shard's, under TP); compiled on CPU
        # it needs bf16 (torch 2.13).
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1
        hidden, dim = w1.shape[1:]
        size = torch.finfo(dtype).bits // 8
        aligned = (dim * size) % 16 == 0 and (hidden * size) % 16 == 0
        compiling_fp32 = torch.compiler.is_compiling() and dtype != torch.bfloat16
        return (
            hasattr(torch, "_grouped_mm")
            and dtype in (torch.float32, torch.bfloat16)
            and aligned
            and not compiling_fp32
        )

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)
        if self.has_bias:
            for b in (self.w1_bias, self.w2_bias, self.w3_bias):
                nn.init.zeros_(b)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def clamped_swiglu(
    limit: float, alpha: float
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """gpt-oss's gating: ``gate`` clamped above at ``limit``, ``up`` to ``[-limit, limit]``,
    then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def gating(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)

    return gating


def expert_activation(args: MoEArgs) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The routed experts' gating that ``args.activation`` names."""
    if args.activation == "clamped_swiglu":
        return clamped_swiglu(args.swiglu_limit, args.swiglu_alpha)
    return _swiglu


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in here: autocast's where it is on (the grouped GEMM is not an
    autocast op), else the input's."""
    device = x.device.type
    if device != "meta" and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _loop_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    biases: list[torch.Tensor] | None = None,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _swiglu,
) -> torch.Tensor:
    """One matmul chain per expert (the reference; reads the counts on the host)."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts.tolist())):
        gate, up = rows @ w1[e].T, rows @ w3[e].T
        if biases is not None:
            gate, up = gate + biases[0][e], up + biases[2][e]
        out = activation(gate, up) @ w2[e].T
        outs.append(out if biases is None else out + biases[1][e])
    return torch.cat(outs)


def _grouped_mm_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    max_padding: bool = False,
    biases: list[torch.Tensor] | None = None,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _swiglu,
) -> torch.Tensor:
    """All experts in three grouped GEMMs; each expert's rows are padded to ``ALIGN_ROWS``.
    ``max_padding`` sizes the padded buffer for the most padding there can be instead of
    reading the padded total on the host (no device sync). ``biases``: ``w1``'s, ``w2``'s and
    ``w3``'s, ``[E, out]`` each, added to each row by its expert."""
    padded_counts = (counts + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
    ends = torch.cumsum(padded_counts, 0)
    # Row i of expert e moves from its place in x to the start of e's padded group + its rank.
    shift = (ends - padded_counts) - (torch.cumsum(counts, 0) - counts)
    dest = torch.arange(x.shape[0], device=x.device) + torch.repeat_interleave(
        shift, counts, output_size=x.shape[0]
    )
    if max_padding or no_values(x) or isinstance(x, LocalTensor):
        # Shapes only (dry runs), or simulated ranks whose routings differ: the most padding
        # there can be (rows past the last group are left out of every GEMM).
        total = x.shape[0] + (ALIGN_ROWS - 1) * counts.shape[0]
    else:
        total = int(ends[-1]) if len(ends) else 0
    padded = x.new_zeros(total, x.shape[1]).index_copy(0, dest, x)
    offs = ends.to(torch.int32)
    gate = torch._grouped_mm(padded, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(padded, w3.transpose(-2, -1), offs=offs)
    if biases is not None:  # on the real rows only (rows past the last group hold garbage)
        experts = torch.arange(counts.shape[0], device=x.device)
        row_expert = torch.repeat_interleave(experts, counts, output_size=x.shape[0])
        gate = gate.index_add(0, dest, biases[0][row_expert])
        up = up.index_add(0, dest, biases[2][row_expert])
    out = torch._grouped_mm(activation(gate, up), w2.transpose(-2, -1), offs=offs)[dest]
    return out if biases is None else out + biases[1][row_expert]


class ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None

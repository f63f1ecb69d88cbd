"""Tensor-parallel machinery shared by models: loss parallel, async TP, a gradient-sum style,
styles for layers whose partial outputs are reduced once (mixture-of-experts layers).

The per-model plans (which module is colwise, rowwise, sequence parallel) live in each model's
``parallelize.py``; this module knows nothing about any model.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def apply_tp_embedding_and_output(
    model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, sequence_parallel: bool
) -> None:
    """The plan of a decoder's ends, for families with ``tok_embeddings``, ``norm`` and
    ``output`` at the top: the embedding table split by rows (its output replicated, or
    sharded along the sequence with sequence parallelism), the final norm sequence-parallel,
    the output projection by columns (the logits sharded over the vocabulary into the loss
    with loss parallelism). A pipeline stage's missing modules (``None``) are skipped."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    plan = {name: style for name, style in plan.items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, plan)


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocab-sharded logits without gathering them (forward and backward)."""
    return _nested_loss_parallel() if enabled else contextlib.nullcontext()


_loss_parallel_open: list[contextlib.AbstractContextManager] = []  # the one open context
_loss_parallel_depth = 0


@contextlib.contextmanager
def _nested_loss_parallel() -> Iterator[None]:
    """torch's ``loss_parallel`` registers its handlers process-wide and cannot nest: an inner
    exit would remove them under the outer block. Simulated pipeline ranks are threads that
    take turns inside their own blocks (``COMM_MODE=local_tensor``), so the handlers are
    registered when the first block opens and removed when the last one closes, whichever
    that is."""
    global _loss_parallel_depth
    if _loss_parallel_depth == 0:
        context = loss_parallel()
        context.__enter__()
        _loss_parallel_open.append(context)
    _loss_parallel_depth += 1
    try:
        yield
    finally:
        _loss_parallel_depth -= 1
        if _loss_parallel_depth == 0:
            _loss_parallel_open.pop().__exit__(None, None, None)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor overlap TP collectives with matmuls. Needs CUDA and compiled blocks: the
    config pre-flight (``config/validation.py``) refuses it otherwise."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


class SumGradients(ParallelStyle):
    """For a module whose output is replicated over the TP ranks but which each rank uses only
    for its own share of the work (a key part shared by every attention head, when the heads
    are split): forward unchanged, backward sums the output's gradient over the mesh, so the
    module's parameters and inputs get the gradient of the whole model on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(
            lambda _module, _inputs, output: sum_gradients(output, device_mesh)
        )
        return module


def sum_gradients(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` unchanged; in backward its gradient is summed over ``mesh``: for a plain tensor
    that is the same on every TP rank but feeds each rank's share of a split computation."""
    return _SumGradientsFn.apply(x, mesh)


class ShardParameters(ParallelStyle):
    """Split a module's parameters over the TP mesh, each along the given dim (DTensors
    ``Shard(dim)``, so checkpoints hold them whole under their names); the module runs on
    the local shards itself (it calls ``to_local()``), with no hooks. For the routed
    experts, whose ``[experts, hidden, dim]`` weights split along ``hidden``."""

    def __init__(self, dims: dict[str, int]):
        super().__init__()
        self.dims = dims

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, dim in self.dims.items():
            param = getattr(module, name)
            sharded = distribute_tensor(
                param.data, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank
            )
            module.register_parameter(
                name, nn.Parameter(sharded, requires_grad=param.requires_grad)
            )
        return module


class GatherInputReduceOutput(ParallelStyle):
    """For a layer that every TP rank runs on the whole input and that returns this rank's
    partial sum of its output (its share of a split width), in plain tensors. The input,
    laid out as ``layout`` (``Shard(1)``: sequence shards; ``Replicate()``), is gathered
    whole, and its gradient, this rank's partial sum, goes back reduce-scattered (or
    all-reduced); the output is reduced to ``layout`` and its gradient gathered. The layer
    itself must leave its input's gradient as a partial sum: a part every rank computes
    whole (a replicated router) counts ``1 / ranks`` of it."""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(
            lambda _module, args: (self._gather(args[0], device_mesh), *args[1:])
        )
        module.register_forward_hook(
            lambda _module, _args, output: self._reduce(output, device_mesh)
        )
        return module

    def _gather(self, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(x, DTensor):  # (a sequence-parallel norm before it gives a DTensor)
            x = DTensor.from_local(x, mesh, (self.layout,), run_check=False)
        return x.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))

    def _reduce(self, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        partial = DTensor.from_local(out, mesh, (Partial(),), run_check=False)
        return partial.redistribute(mesh, (self.layout,)).to_local()


class ReplicatedInputPartialGradient(ParallelStyle):
    """For a module whose input is the same plain tensor on every TP rank but whose input's
    gradient is summed over the ranks later, together with other partial gradients of that
    tensor (inside a :class:`GatherInputReduceOutput` layer): the input enters as a
    ``Replicate`` DTensor, and its gradient leaves as this rank's partial sum, not reduced
    here."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(
            lambda _module, args: (_ReplicatedPartialGradFn.apply(args[0], device_mesh), *args[1:])
        )
        return module


class _ReplicatedPartialGradFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        return DTensor.from_local(x.view_as(x), mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        # Partial sums: this rank's contributions as they are. A whole gradient (replicated)
        # becomes an equal share per rank, by hand: compiled, redistributing to Partial is
        # refused. (A compiled backward takes the placement traced in forward; either branch
        # gives the same sum over the ranks.)
        mesh, placement = grad.device_mesh, grad.placements[0]
        if isinstance(placement, Partial):
            if placement.reduce_op != "sum":
                raise ValueError(f"a gradient that is {placement} cannot be a partial sum")
            return grad.to_local(), None
        return grad.redistribute(mesh, (Replicate(),)).to_local() / mesh.size(0), None


class PartialRowwiseParallel(RowwiseParallel):
    """Row-parallel linear whose output stays this rank's partial sum, as a plain tensor: the
    caller adds it to other partial sums and reduces once (a ``Partial`` output layout of the
    enclosing module's plan). The output's gradient is taken as the whole gradient, the same
    on every rank, which it is once that reduction's backward ran."""

    def __init__(self):
        super().__init__(output_layouts=Partial())

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local(grad_placements=(Replicate(),))


class _SumGradientsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.mesh), None

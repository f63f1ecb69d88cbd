"""Expert parallelism: each rank of the ``ep`` mesh holds ``num_experts / ep`` of a layer's
routed experts; routed rows travel to the rank that holds their expert and back.

:func:`apply_ep` shards an experts module's weights over the experts (DTensors ``Shard(0)``
on ``ep``, so checkpoints hold every expert under its global name) and hooks its forward.
The experts module takes ``(rows [N, dim] grouped by global expert, counts [E])``; the hooks
turn that into this rank's experts' rows:

1. the per-expert counts are exchanged (an even all-to-all of ``E`` integers): rank r learns
   how many rows every peer sends to each of its experts;
2. the rows go to their expert's rank in one all-to-all with uneven splits (autograd-aware:
   backward sends the gradients the other way);
3. received rows, ordered by source rank then expert, are regrouped by expert;
4. after the experts ran, the inverse: ungroup, all-to-all back, in the sender's order.

Works on any backend that has all-to-all (gloo, NCCL). Simulated ranks
(``COMM_MODE=local_tensor``) route differently but must share shapes: there each rank sends
every peer a slot of the most rows it could send (all of them), padded with zeros
(:meth:`_Dispatcher.dispatch_padded`). Gradients of the expert weights are complete on their
rank (every token that used an expert sent its rows there), so the experts
module scales them by ``1 / ep`` (``weight_grad_scale``) and FSDP averages over the ranks
that hold the same experts (``efsdp``): together the mean over every data-parallel rank, as
for the rest of the model. With TP, the EP group spans the TP ranks: each routes its own
sequence shard (``models/deepseek_v3/parallelize.py``), and the scale is ``tp / ep``. (FSDP's
own divide factor would need a reduce op gloo lacks.)
The experts module must have a ``weight_grad_scale`` attribute.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchtitan.distributed import local_tensor
from torchtitan.distributed.utils import values_are_real


def apply_ep(
    experts_modules: list[nn.Module], ep_mesh: DeviceMesh, *, data_parallel_ranks: int
) -> None:
    """Shard each module's parameters over ``ep_mesh`` along dim 0 (the experts) and route
    its inputs and outputs through the all-to-alls (see the module docstring).
    ``data_parallel_ranks``: how many data-parallel ranks' tokens meet in one EP group (``ep``,
    or ``ep / tp`` where the group spans TP ranks that each route a share of the same tokens)."""
    for experts in experts_modules:
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)]))
            experts.register_parameter(name, sharded)
        # An expert's gradient sums the tokens of every data-parallel rank of the EP group;
        # data-parallel averaging (FSDP over the ranks left) divides by the others only.
        experts.weight_grad_scale = 1 / data_parallel_ranks
        experts.register_forward_pre_hook(_Dispatcher(ep_mesh).dispatch)


class _Dispatcher:
    """The pre-hook sends the rows away and swaps the module's inputs for its own experts'
    rows; a one-shot forward hook it registers brings the outputs back."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self._combine = None  # the pending forward hook of the current call

    def dispatch(self, module: nn.Module, inputs: tuple) -> tuple:
        rows, counts = inputs
        if isinstance(rows, LocalTensor):
            return self.dispatch_padded(module, rows, counts)
        ep = self.mesh.size()
        group = self.mesh.get_group()
        num_experts = counts.shape[0]
        local = num_experts // ep
        # 1. How many rows each peer sends to each of this rank's experts: [ep, local].
        if isinstance(rows, FakeTensor) or rows.device.type == "meta" or not values_are_real():
            # Dry runs: no values to exchange; every rank sends and receives alike.
            received_counts = counts.view(ep, local)
            send_splits = recv_splits = _even_splits(rows.shape[0], ep)
        else:
            received_counts = torch.empty_like(counts)
            dist.all_to_all_single(received_counts, counts.contiguous(), group=group)
            received_counts = received_counts.view(ep, local)
            # Both in one read on the host: one wait for the device, not two.
            splits = torch.stack([counts.view(ep, local).sum(dim=1), received_counts.sum(dim=1)])
            send_splits, recv_splits = splits.tolist()
        # 2. The rows themselves.
        received = funcol.all_to_all_single_autograd(rows, recv_splits, send_splits, group)
        # 3. Ordered by (source, expert): regroup by (expert, source).
        segment_key = torch.arange(ep * local, device=rows.device).view(ep, local)
        segment_key = (segment_key % local) * ep + segment_key // local
        row_key = torch.repeat_interleave(
            segment_key.flatten(), received_counts.flatten(), output_size=received.shape[0]
        )
        regroup = row_key.argsort(stable=True)

        def combine(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            self._combine.remove()
            self._combine = None
            # 4. Back in (source, expert) order, then to the senders.
            ungrouped = torch.empty_like(output).index_copy(0, regroup, output)
            return funcol.all_to_all_single_autograd(ungrouped, send_splits, recv_splits, group)

        if self._combine is not None:  # a previous forward raised before its hook ran
            self._combine.remove()
        self._combine = module.register_forward_hook(combine)
        return received[regroup], received_counts.sum(dim=0)

    def dispatch_padded(self, module: nn.Module, rows: torch.Tensor, counts: torch.Tensor):
        """:meth:`dispatch` for simulated ranks, in shapes every rank shares: the ``n`` rows
        (all routings: no capacity dropping) go out in ``ep`` slots of ``m`` rows, one per
        peer, each filled from the front, with ``m`` the most any simulated rank (of this
        process or pipeline thread) sends any peer; the received rows, regrouped by (expert, source), come first and the zero
        padding last. The padding goes to the last expert: nobody reads its outputs, so it
        adds nothing to the weights' (or biases') gradients."""
        ep, group, n = self.mesh.size(), self.mesh.get_group(), rows.shape[0]
        local = counts.shape[0] // ep
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts.contiguous(), group=group)
        received_counts = received_counts.view(ep, local)
        peer_counts = counts.view(ep, local).sum(dim=1)
        m = local_tensor.max_over_ranks(peer_counts)
        # Row i (grouped by expert, so by peer) goes to its peer's slot, from the front.
        peer = torch.repeat_interleave(
            torch.arange(ep, device=rows.device), peer_counts, output_size=n
        )
        starts = torch.cumsum(peer_counts, 0) - peer_counts
        slot = peer * m + torch.arange(n, device=rows.device) - starts[peer]
        sent = rows.new_zeros(ep * m, rows.shape[1]).index_copy(0, slot, rows)
        received = _EvenAllToAll.apply(sent, group)
        # Source s's block: its rows for this rank's experts, by expert, then zeros.
        ends = torch.cumsum(received_counts, dim=1)
        position = torch.arange(m, device=rows.device).expand(ep, m).contiguous()
        expert = torch.searchsorted(ends, position, right=True)  # ``local`` past the rows
        source = torch.arange(ep, device=rows.device).unsqueeze(1).expand(ep, m)
        key = torch.where(expert < local, expert * ep + source, ep * local)
        regroup = key.flatten().argsort(stable=True)
        expert_counts = received_counts.sum(dim=0)
        expert_counts[-1] += ep * m - expert_counts.sum()

        def combine(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            self._combine.remove()
            self._combine = None
            ungrouped = torch.empty_like(output).index_copy(0, regroup, output)
            return _EvenAllToAll.apply(ungrouped, group)[slot]

        if self._combine is not None:
            self._combine.remove()
        self._combine = module.register_forward_hook(combine)
        return received[regroup], expert_counts


class _EvenAllToAll(torch.autograd.Function):
    """All-to-all of equal parts; backward sends the gradients back the same way. (The
    simulation of ranks lacks the autograd-aware functional all-to-all.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def _even_splits(rows: int, parts: int) -> list[int]:
    return [rows // parts + (i < rows % parts) for i in range(parts)]

"""Mixture-of-experts feed-forward layer, for any model family: a router picks ``top_k`` routed
experts per token, the experts (SwiGLU, all in three ``[experts, out, in]`` weights) run on
the rows routed to them, the shared experts on every token.

Shapes: ``T`` tokens of the batch (``bs x seq``), ``E`` routed experts, ``k`` experts per
token, ``dim`` model width, ``hidden`` an expert's hidden width.

Balancing (``MoEArgs``): DeepSeek-V3's auxiliary-loss-free bias (``expert_bias``, added to the
scores for the choice of experts only, moved after each optimizer step by
:func:`update_expert_biases` from the global token counts) and, optionally, the sequence-wise
balance loss, whose gradient the layer adds itself (the trainer's loss stays the language
model's). The routed experts are ``experts.py``'s; expert parallelism
(``distributed/expert_parallel.py``) hooks them: rows travel to the rank that holds their expert and back, the layer does not know. Tensor
parallelism without it splits every expert's hidden width (``MoE.hidden_split_mesh``).
"""

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.distributed import local_tensor
from torchtitan.distributed.tensor_parallel import sum_gradients
from torchtitan.models.common.experts import (
    GroupedExperts,
    ScaleGradient,
    expert_activation,
    no_values,
)
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe_args import MoEArgs
from torchtitan.tools.module_names import clean_name


class Router(nn.Module):
    """Token-choice top-k routing: ``x [T, dim]`` -> weights ``[T, k]`` (fp32), expert indices
    ``[T, k]`` and every expert's score ``[T, E]`` (fp32, for the balance loss)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.args
        logits = self.gate(x).float()
        scores = logits.sigmoid() if a.score_func == "sigmoid" else logits.softmax(dim=-1)
        # The bias only steers the choice; the weights come from the unbiased scores.
        choice = scores if expert_bias is None else scores + expert_bias
        if a.num_groups > 1:
            choice = _limit_to_top_groups(choice, a.num_groups, a.top_groups)
        if a.force_load_balance:  # round robin: token t's j-th routing to (t k + j) mod E
            rows = x.shape[0] * a.top_k
            indices = torch.arange(rows, device=x.device).remainder(a.num_experts)
            indices = indices.view(-1, a.top_k)
        else:
            indices = choice.topk(a.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, indices, scores

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=0.02)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)


def _limit_to_top_groups(choice: torch.Tensor, num_groups: int, top_groups: int) -> torch.Tensor:
    """``choice [T, E]`` with the experts outside each token's ``top_groups`` best groups set
    to -inf; a group's score is the sum of its two best experts (one if groups have one)."""
    grouped = choice.view(choice.shape[0], num_groups, -1)
    best = min(2, grouped.shape[-1])
    group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)
    keep = group_scores.topk(top_groups, dim=-1, sorted=False).indices
    mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
    return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` gets the gradient ``weight``, as if
    ``weight x aux`` had been added to the loss (the trainer's loss stays the LM loss)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.aux_dtype = aux.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_grad = torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


class MoE(nn.Module):
    """Routed + shared experts on ``x [bs, seq, dim]`` -> ``[bs, seq, dim]``.

    Buffers: ``expert_bias [E]`` (saved in checkpoints) and ``tokens_per_expert [E]``, this
    rank's routings since the last :func:`update_expert_biases` (under activation
    checkpointing counted again by the recomputation: every count doubles, which keeps the
    sign of each expert's imbalance and every load ratio).
    """

    def __init__(self, dim: int, hidden: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(
            dim, hidden, args.num_experts, args.experts_impl,
            bias=args.expert_linear_bias, activation=expert_activation(args),
        )  # fmt: skip
        self.shared_experts = (
            FeedForward(dim, hidden * args.num_shared_experts) if args.num_shared_experts else None
        )
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.loss_scale = 0.0
        """Gradient weight of one token's loss, set by the batch runner every step (the
        balance loss is weighted like the tokens it was computed on)."""
        self.aux_loss: torch.Tensor | None = None
        """The last forward's balance loss (detached), for metrics."""
        self.token_split_mesh = None
        """Set by a tensor-parallel plan that gives each TP rank its own share of the tokens
        (a sequence shard): the token counts are then summed over it too."""
        self.context_parallel_mesh = None
        """Set by a context-parallel plan: each rank holds a shard of every sequence (its
        token counts are summed with the loss's ranks already)."""
        self.hidden_split_mesh = None
        """Set by a tensor-parallel plan that splits every expert's hidden width over the TP
        ranks (the routed experts' weights, the shared experts column- then row-wise): every
        rank routes the same whole tokens and returns a partial sum of the output, which the
        plan reduces after the layer; it also sums the input's gradient over the ranks
        (``tensor_parallel.GatherInputReduceOutput``). Here the routing weights' gradient is
        summed over the ranks, and the router's part of the input's gradient (whole on every
        rank) is scaled to a share."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        bs, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        router_input = flat
        if self.hidden_split_mesh is not None:
            # The input's gradient is a partial sum on each rank, summed after the layer:
            # the router's, whole on every rank, counts for its share.
            router_input = ScaleGradient.apply(flat, 1 / self.hidden_split_mesh.size())
        # Zero unless balancing moved it (or it was loaded): it steers the choice either way.
        weights, indices, scores = self.router(router_input, self.expert_bias)
        routed = indices.flatten()  # [T * k]: token t's j-th choice at t * k + j
        if no_values(routed):
            # Fake or meta tensors (dry runs, pipeline shape inference) have shapes, not
            # values: assume balanced routing.
            counts = _balanced_counts(routed.shape[0], a.num_experts, routed.device)
        else:
            # Not bincount: on CUDA it reads the ids' min and max on the host every layer.
            counts = routed.new_zeros(a.num_experts).scatter_add_(
                0, routed, torch.ones_like(routed)
            )
        if self.training:  # evaluation passes do not steer the balancing
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        order = routed.argsort(stable=True)  # routings grouped by expert, tokens in order
        route_weights = weights.flatten()
        if a.capacity_factor > 0:
            order, counts, route_weights = _drop_over_capacity(
                order, counts, route_weights, routed, a.capacity_factor
            )
        if self.hidden_split_mesh is not None:  # each rank's gradient is a partial sum
            route_weights = sum_gradients(route_weights, self.hidden_split_mesh)
        rows = flat[order // a.top_k]
        if a.score_before_experts:  # each row scaled by its weight on the way in
            rows = (rows * route_weights[order].unsqueeze(-1)).to(rows.dtype)
        out_rows = self.experts(rows, counts)
        # Back to token order, weighted (unless it was on the way in), summed over each
        # token's k experts.
        combined = flat.new_zeros(routed.shape[0], dim, dtype=out_rows.dtype)
        combined = combined.index_copy(0, order, out_rows).view(-1, a.top_k, dim)
        if not a.score_before_experts:
            combined = combined * route_weights.view(-1, a.top_k, 1)
        out = combined.sum(1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if a.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled():
            splits = self.sequence_splits()
            aux = a.aux_loss_coeff * sequence_balance_loss(
                scores.view(bs, seq, -1),
                indices.view(bs, seq, -1),
                groups=[m.get_group() for m in splits],
            )
            # Weighted like the tokens it covers: the whole sequences when split over ranks.
            tokens = flat.shape[0] * math.prod(m.size() for m in splits)
            out = _AddAuxLoss.apply(out, aux, self.loss_scale * tokens)
            self.aux_loss = aux.detach()  # this shard's part when split (summed when logged)
        return out.view(bs, seq, dim)

    def sequence_splits(self) -> list:
        """The meshes whose ranks each hold a shard of every sequence this layer sees (TP ranks
        routing their own shard, CP ranks)."""
        return [m for m in (self.token_split_mesh, self.context_parallel_mesh) if m is not None]

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        self.router.init_weights()
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()


def _balanced_counts(rows: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """``rows`` spread as evenly as possible over the experts (a plain tensor)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        counts = torch.full((num_experts,), rows // num_experts, dtype=torch.int64)
        counts[: rows % num_experts] += 1
    return counts.to(device)


def _drop_over_capacity(
    order: torch.Tensor,
    counts: torch.Tensor,
    weights: torch.Tensor,
    routed: torch.Tensor,
    capacity_factor: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep each expert's ``capacity`` highest-weighted routings: the kept routings (grouped
    by expert), the kept counts, and the weights with dropped routings at zero."""
    num_experts = counts.shape[0]
    capacity = math.ceil(capacity_factor * routed.shape[0] / num_experts)
    by_weight = weights.detach().argsort(descending=True, stable=True)
    ranked = by_weight[routed[by_weight].argsort(stable=True)]  # by expert, best first
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(routed.shape[0], device=routed.device) - torch.repeat_interleave(
        starts, counts, output_size=routed.shape[0]
    )
    kept = ranked[place < capacity].sort().values
    kept = kept[routed[kept].argsort(stable=True)]  # grouped by expert again, tokens in order
    keep = torch.zeros_like(weights, dtype=torch.bool).index_fill_(0, kept, True)
    return kept, counts.clamp(max=capacity), weights * keep


def sequence_balance_loss(
    scores: torch.Tensor, indices: torch.Tensor, groups: Sequence[dist.ProcessGroup] = ()
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences: per sequence,
    ``sum_e f_e * P_e`` with ``f_e`` the share of routings expert ``e`` got, times ``E / k``
    (1 when balanced), and ``P_e`` its mean normalised score. ``scores [bs, seq, E]``,
    ``indices [bs, seq, k]``.

    With ``groups``, each rank holds a shard of every sequence (``seq`` of its tokens), split
    over every group's ranks: the routing shares are summed over the groups, and this rank
    returns its shard's part of the loss (the parts sum to the loss of the whole sequences)."""
    bs, seq, num_experts = scores.shape
    k = indices.shape[-1]
    picks = torch.zeros(bs, num_experts, device=scores.device)
    picks.scatter_add_(1, indices.reshape(bs, -1), torch.ones(bs, seq * k, device=scores.device))
    full_seq = seq
    for group in groups:
        dist.all_reduce(picks, group=group)
        full_seq *= dist.get_world_size(group)
    f = picks * num_experts / (k * full_seq)
    p = (scores / scores.sum(dim=-1, keepdim=True)).sum(dim=1) / full_seq
    return (f * p).sum(dim=1).mean()


def moe_layers(model_parts: list[nn.Module]) -> list[tuple[str, MoE]]:
    """Every MoE layer of the model parts, with its name (``layers.3.moe``)."""
    return [
        (clean_name(name), m)
        for part in model_parts
        for name, m in part.named_modules()
        if isinstance(m, MoE)
    ]


@torch.no_grad()
def update_expert_biases(
    model_parts: list[nn.Module],
    group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None = None,
    *,
    report: bool = True,
) -> dict[str, float]:
    """After an optimizer step: sum every layer's token counts over ``group`` (the ranks that
    see different tokens), move each expert's bias by ``load_balance_coeff`` towards balance,
    reset the counts. Returns metrics: per layer the busiest expert's load over the mean
    (``moe_load_max_over_mean/<layer>``), their mean over layers, the mean absolute bias
    change and the balance loss (when on). Under pipeline parallelism (``pp_group``) every
    stage's layers are reported on every rank. ``report=False`` (a step that logs nothing):
    the update only, on the device, without reading values on the host."""
    layers = moe_layers(model_parts)
    if not layers:  # a pipeline stage of dense blocks still joins the stages' gather
        return _merge_stages({}, pp_group) if pp_group is not None and report else {}
    counts = torch.stack([m.tokens_per_expert for _, m in layers])  # [layers, E]
    if no_values(counts):  # a dry run's step on fake tensors: no values
        return {}
    split = layers[0][1].token_split_mesh
    if split is not None:  # every TP rank routed its own sequence shard
        dist.all_reduce(counts, group=split.get_group())
    if group is not None:
        dist.all_reduce(counts, group=group)
    mean = counts.mean(dim=1, keepdim=True)
    direction = torch.sign(mean - counts)  # +1 below the mean load, -1 above
    changes = []
    for (_, m), d in zip(layers, direction, strict=True):
        # Forced routings (--moe.force_load_balance) are nothing the bias should learn from.
        coeff = 0.0 if m.args.force_load_balance else m.args.load_balance_coeff
        if coeff > 0:
            m.expert_bias += coeff * d
            changes.append(coeff * d.abs().mean())
        m.tokens_per_expert.zero_()
    if not report:
        return {}
    ratio = (counts.max(dim=1).values / mean.squeeze(1).clamp(min=1e-9)).tolist()
    metrics = {
        f"moe_load_max_over_mean/{name}": r for (name, _), r in zip(layers, ratio, strict=True)
    }
    metrics["moe_load_max_over_mean"] = sum(ratio) / len(ratio)
    if changes:
        metrics["moe_bias_update"] = float(torch.stack(changes).mean())
    aux = [m.aux_loss for _, m in layers if m.aux_loss is not None]
    if aux:
        total = torch.stack(aux).sum()
        for mesh in layers[0][1].sequence_splits():  # each rank holds its shard's part
            dist.all_reduce(total, group=mesh.get_group())
        metrics["moe_aux_loss"] = float(local_tensor.value_on_rank(total, local_tensor.own_rank()))
    if pp_group is not None:
        metrics = _merge_stages(metrics, pp_group)
    return metrics


def _merge_stages(metrics: dict[str, float], pp_group: dist.ProcessGroup) -> dict[str, float]:
    """Every stage's per-layer metrics on every rank; means over all layers, summed balance
    losses."""
    stages: list[dict[str, float] | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, metrics, group=pp_group)
    merged = {k: v for stage in stages for k, v in stage.items() if "/" in k}
    loads = [v for k, v in merged.items() if k.startswith("moe_load_max_over_mean/")]
    if loads:
        merged["moe_load_max_over_mean"] = sum(loads) / len(loads)
    for key, reduce in (("moe_bias_update", "mean"), ("moe_aux_loss", "sum")):
        values = [stage[key] for stage in stages if key in stage]
        if values:
            merged[key] = sum(values) / (len(values) if reduce == "mean" else 1)
    return merged

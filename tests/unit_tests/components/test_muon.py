"""Muon (``--optimizer.name Muon``): orthogonalised momentum for the blocks' matrices, AdamW
for the rest, one schedule, exact resume."""

import contextlib
import copy
import math

import pytest
import torch
from torch import nn
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard

from torchtitan.components import muon
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.muon import Muon, muon_takes, orthogonalise
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, LRScheduler, Optimizer
from torchtitan.config.validation import validate
from torchtitan.distributed.local_tensor import local_tensor_mode

CPU = torch.device("cpu")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, 6)
        self.layers = nn.ModuleList(
            [nn.ModuleDict({"w": nn.Linear(6, 6), "norm": nn.LayerNorm(6)})]
        )
        self.experts = nn.Parameter(torch.randn(3, 6, 4) * 0.1)  # outside the blocks: AdamW
        self.output = nn.Linear(6, 8, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        block = self.layers[0]
        h = block["w"](block["norm"](h)) + torch.einsum("bsd,edf->bs", h, self.experts)[..., None]
        return self.output(h)


def _loss(model):
    return model(torch.arange(8).reshape(2, 4)).logsumexp(-1).mean()


@pytest.mark.parametrize("shape", [(6, 6), (4, 9), (9, 4), (3, 5, 7)])
def test_orthogonalise_pushes_singular_values_toward_one(shape):
    torch.manual_seed(0)
    update = torch.randn(shape)
    ortho = orthogonalise(update, steps=5)
    assert ortho.shape == update.shape and ortho.dtype == torch.float32
    singular = torch.linalg.svdvals(ortho)
    assert singular.min() > 0.5 and singular.max() < 1.3  # the quintic's band, not exactly 1
    if len(shape) == 3:  # per matrix of a stack
        for e in range(shape[0]):
            torch.testing.assert_close(ortho[e], orthogonalise(update[e], steps=5))


def test_the_iteration_in_bfloat16_is_the_float32_one_to_bf16_precision():
    torch.manual_seed(0)
    update = torch.randn(4, 48, 16)
    exact = orthogonalise(update, steps=5)
    low = orthogonalise(update, steps=5, dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16
    assert 0 < (low.float() - exact).norm() / exact.norm() < 0.05
    singular = torch.linalg.svdvals(low.float())
    assert singular.min() > 0.5 and singular.max() < 1.3


def test_muon_ns_dtype_sets_the_iterations_precision():
    """``--optimizer.muon_ns_dtype bfloat16`` reaches the step: its update differs from the
    float32 iteration's by bf16 rounding, not more."""
    steps = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model = Tiny()
        optimizers = build_optimizers(
            [model], Optimizer(name="Muon", lr=0.01, muon_ns_dtype=dtype), CPU
        )
        (muon_optimizer,) = [o for o in optimizers.optimizers if isinstance(o, Muon)]
        assert muon_optimizer.ns_dtype == getattr(torch, dtype)
        _loss(model).backward()
        before = model.layers[0]["w"].weight.detach().clone()
        optimizers.step()
        steps[dtype] = model.layers[0]["w"].weight.detach() - before
    change = (steps["bfloat16"] - steps["float32"]).norm() / steps["float32"].norm()
    assert 0 < change < 0.1  # 5.5%: bf16's 8-bit mantissa, through five iterations


def test_a_step_is_the_formula_and_close_to_torch_muon():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(6, 10))
    grad = torch.randn(6, 10)
    mine = copy.deepcopy(weight)
    mine.grad = grad.clone()
    Muon([mine], lr=0.02, momentum=0.95, weight_decay=0.1).step()
    update = grad + 0.95 * grad  # Nesterov on a fresh buffer
    expected = weight * (1 - 0.02 * 0.1) - 0.02 * 0.2 * math.sqrt(10) * orthogonalise(update, 5)
    torch.testing.assert_close(mine, expected)
    theirs = copy.deepcopy(weight)
    theirs.grad = grad.clone()
    torch.optim.Muon(
        [theirs], lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    ).step()
    torch.testing.assert_close(mine, theirs, atol=2e-3, rtol=0)  # theirs iterates in bf16


def _two_steps(params, grads, comms=None, ns_dtype=torch.float32):
    """Two Muon steps, the second's update holding momentum; ``grads``: each step's gradients,
    made before (only the steps run inside ``comms``)."""
    optimizer = Muon(params, lr=0.02, weight_decay=0.1, ns_steps=3, ns_dtype=ns_dtype)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        with comms or contextlib.nullcontext():
            optimizer.step()


def _place(tensor, mesh, placements):
    """``tensor`` distributed as ``placements`` say; a ``_StridedShard`` (FSDP over a TP shard
    of the same dimension) is reached from the TP layout, as FSDP2 makes it."""
    if not any(isinstance(p, _StridedShard) for p in placements):
        return distribute_tensor(tensor, mesh, placements)
    tp_only = [Replicate() if isinstance(p, _StridedShard) else p for p in placements]
    return distribute_tensor(tensor, mesh, tp_only).redistribute(mesh, placements)


# (mesh, placements, shape, matrices, matrices each rank orthogonalises): FSDP's rows, TP's
# columns, FSDP x TP (rowwise; columnwise, as FSDP2 shards a TP shard's rows again), HSDP (the
# replicas repeat their shard group's work), EP's experts split along their width too, EP's
# experts alone (whole where they lie: no collective).
LAYOUTS = {
    "fsdp": ((4,), (Shard(0),), (8, 12), 8, 2),
    "tp_columns": ((4,), (Shard(1),), (8, 12), 4, 1),
    "fsdp_x_tp": ((2, 2), (Shard(0), Shard(1)), (8, 12), 4, 1),
    "fsdp_x_tp_columns": ((2, 2), (_StridedShard(0, split_factor=2), Shard(0)), (8, 12), 4, 1),
    "hsdp": ((2, 2), (Replicate(), Shard(0)), (8, 12), 4, 2),
    "ep_x_width": ((2, 2), (Shard(0), Shard(2)), (4, 8, 12), 2, 2),
    "ep": ((4,), (Shard(0),), (4, 8, 12), 2, 2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_matrices_are_split_among_the_ranks_and_step_as_one_process(layout, monkeypatch):
    """Simulated ranks: the step is bitwise the one-process step, and each rank orthogonalises
    only its share of the matrices (before: all of them, whole, on every rank)."""
    mesh_shape, placements, shape, count, per_rank = LAYOUTS[layout]
    torch.manual_seed(0)
    weights = [torch.randn(shape) for _ in range(count)]
    grads = [torch.randn(shape) for _ in range(count)]
    expected = [nn.Parameter(w.clone()) for w in weights]
    _two_steps(expected, [[g * s for g in grads] for s in (1.0, 0.5)])

    orthogonalised = []

    def counting(x, steps, **kwargs):
        orthogonalised.append(x.numel() // (x.shape[-2] * x.shape[-1]))
        return orthogonalise(x, steps, **kwargs)

    monkeypatch.setattr(muon, "orthogonalise", counting)
    with local_tensor_mode(4):
        mesh = init_device_mesh("cpu", mesh_shape)
        params = [nn.Parameter(_place(w, mesh, placements)) for w in weights]
        sharded = [[_place(g * s, mesh, placements) for g in grads] for s in (1.0, 0.5)]
        comms = CommDebugMode()
        _two_steps(params, sharded, comms)
        got = [p.full_tensor().detach() for p in params]
        got = [t.reconcile() if isinstance(t, LocalTensor) else t for t in got]
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(have, want.detach())
    assert sum(orthogonalised) == 2 * per_rank  # two steps
    if layout == "ep":
        assert comms.get_total_counts() == 0


def test_a_stack_of_matrices_not_a_multiple_of_the_ranks_steps_as_one_process():
    """5 matrices over 4 ranks: stacks of 4, then 1 (rank 0 takes it, the others none; on
    torch 2.11 the simulation fills the stack with zero matrices)."""
    torch.manual_seed(0)
    weights = [torch.randn(8, 12) for _ in range(5)]
    grads = [torch.randn(8, 12) for _ in range(5)]
    expected = [nn.Parameter(w.clone()) for w in weights]
    _two_steps(expected, [[g * s for g in grads] for s in (1.0, 0.5)])
    with local_tensor_mode(4):
        mesh = init_device_mesh("cpu", (4,))
        params = [nn.Parameter(distribute_tensor(w, mesh, [Shard(1)])) for w in weights]
        _two_steps(
            params,
            [[distribute_tensor(g * s, mesh, [Shard(1)]) for g in grads] for s in (1.0, 0.5)],
        )
        got = [p.full_tensor().detach().reconcile() for p in params]
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(have, want.detach())


def test_a_group_of_many_layouts_and_partial_gradients_steps_as_one_process():
    """One param group holding stacks of two layouts, EP experts, a replicated matrix whose
    gradient arrives as partial sums, and a plain tensor, iterated in bf16: every result reaches
    its own parameter (bitwise the one-process step)."""
    torch.manual_seed(0)
    layouts = [((Shard(0),), (8, 12))] * 3 + [((Shard(1),), (12, 8))] * 2
    layouts += [((Shard(0),), (4, 8, 12)), ((Replicate(),), (6, 10)), (None, (5, 7))]
    weights = [torch.randn(shape) for _, shape in layouts]
    # Multiples of 1/8: the partial sums (quarters) add up exactly.
    grads = [torch.randint(-8, 9, shape) / 8 for _, shape in layouts]
    expected = [nn.Parameter(w.clone()) for w in weights]
    _two_steps(expected, [[g * s for g in grads] for s in (1.0, 0.5)], ns_dtype=torch.bfloat16)
    with local_tensor_mode(4):
        mesh = init_device_mesh("cpu", (4,))

        def place(t, placements, partial=False):
            if placements is None:  # a plain tensor: the same on every rank
                return t.clone()
            if partial:
                return DTensor.from_local(t / 4, mesh, [Partial()], run_check=False)
            return distribute_tensor(t, mesh, placements)

        params = [nn.Parameter(place(w, pl)) for w, (pl, _) in zip(weights, layouts, strict=True)]
        sharded = [
            [
                place(g * s, pl, partial=pl == (Replicate(),))
                for g, (pl, _) in zip(grads, layouts, strict=True)
            ]
            for s in (1.0, 0.5)
        ]
        _two_steps(params, sharded, ns_dtype=torch.bfloat16)
        got = [p.full_tensor() if isinstance(p, DTensor) else p for p in params]
        got = [t.detach().reconcile() if isinstance(t, LocalTensor) else t for t in got]
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(have, want.detach())


def test_the_blocks_matrices_take_muon_and_the_rest_adamw():
    model = Tiny()
    optimizers = build_optimizers([model], Optimizer(name="Muon", lr=0.01), CPU)
    kinds = {
        type(o).__name__: sorted(
            n
            for n, p in model.named_parameters()
            for g in o.param_groups
            if any(p is q for q in g["params"])
        )
        for o in optimizers.optimizers
    }
    assert kinds == {
        "Muon": ["layers.0.w.weight"],
        "AdamW": sorted(
            ["tok_embeddings.weight", "layers.0.w.bias", "layers.0.norm.weight",
             "layers.0.norm.bias", "experts", "output.weight"]
        ),
    }  # fmt: skip
    assert optimizers.parts == [0, 0]
    assert muon_takes("layers.1.moe.experts.w1", torch.empty(4, 6, 8))


def test_schedule_groups_and_resume_cover_both_optimizers(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    config = Optimizer(name="Muon", lr=0.01, param_groups=["layers.0.w.weight:lr_scale=0.5"])

    def build(m):
        optimizers = build_optimizers([m], config, CPU)
        return optimizers, build_lr_schedulers(
            optimizers, LRScheduler(warmup_steps=2), training_steps=10
        )

    def step(m, optimizers, schedulers):
        optimizers.zero_grad()
        _loss(m).backward()
        optimizers.step()
        schedulers.step()

    optimizers, schedulers = build(model)
    for _ in range(3):
        step(model, optimizers, schedulers)
    factor = schedulers.factor()
    lrs = {type(o).__name__: [g["lr"] for g in o.param_groups] for o in optimizers.optimizers}
    assert lrs == {"AdamW": [0.01 * factor], "Muon": [0.01 * 0.5 * factor]}

    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(optimizers.state_dict())
    assert any(k.endswith("momentum_buffer") for k in saved) and any(
        k.endswith("exp_avg") for k in saved
    )
    saved_schedule = copy.deepcopy(schedulers.state_dict())
    step(model, optimizers, schedulers)

    resumed = Tiny()
    resumed.load_state_dict(saved_model)
    optimizers2, schedulers2 = build(resumed)
    optimizers2.load_state_dict(saved)
    schedulers2.load_state_dict(saved_schedule)
    schedulers2.reapply(config.lr)
    step(resumed, optimizers2, schedulers2)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_bad_muon_settings_are_refused_before_launch():
    config = JobConfig()
    config.optimizer.muon_ns_steps = 0
    with pytest.raises(ConfigError, match="--optimizer.muon_ns_steps=0 must be >= 1"):
        validate(config)

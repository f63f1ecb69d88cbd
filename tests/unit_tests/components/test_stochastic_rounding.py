"""Stochastic rounding of bf16 weights (--optimizer.stochastic_rounding)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from torchtitan.components import stochastic_rounding
from torchtitan.components.muon import Muon
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.stochastic_rounding import (
    RoundedAdam,
    RoundedAdamW,
    Rounding,
    round_bits_,
)
from torchtitan.config.job_config import Optimizer as OptimizerConfig


def _next_up(value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 ``value`` and its neighbour away from zero, as float32."""
    low = torch.tensor(value, dtype=torch.bfloat16)
    high = (low.view(torch.int16) + 1).view(torch.bfloat16)
    return low.float(), high.float()


@pytest.mark.parametrize("value", [1.0, -1.0, 0.3, -7.5, 1e-3])
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_a_rounding_is_one_of_the_two_neighbours_and_unbiased(value, fraction):
    low, high = _next_up(value)
    exact = low + fraction * (high - low)
    n = 400_000
    rounded = round_bits_(exact.repeat(n), torch.Generator().manual_seed(3))
    assert set(rounded.unique().tolist()) == {low.item(), high.item()}
    # The mean's standard deviation: a Bernoulli(fraction) step of (high - low), n draws.
    sigma = (high - low).abs().item() * (fraction * (1 - fraction) / n) ** 0.5
    assert abs(rounded.double().mean().item() - exact.item()) < 5 * sigma
    assert (rounded == high).double().mean().item() == pytest.approx(fraction, abs=0.01)


def test_values_bf16_holds_are_left_as_they_are_and_nan_stays_nan():
    values = torch.randn(10_000).bfloat16().float()
    values[:3] = torch.tensor([0.0, float("inf"), -float("inf")])
    assert torch.equal(round_bits_(values.clone(), torch.Generator().manual_seed(0)), values)
    # NaNs whose bits plus any noise would wrap (to -0.0, +0.0 or inf without the mask)
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000], dtype=torch.int32)
    nans = nans.repeat(1000).view(torch.float32)
    assert round_bits_(nans.clone(), torch.Generator().manual_seed(0)).isnan().all()
    with pytest.raises(ValueError, match="contiguous float32"):
        round_bits_(torch.zeros(4, 4).t(), torch.Generator())


def test_the_bits_depend_on_seed_step_and_parameter_name_only():
    def bits(seed: int, step: int, name: str) -> torch.Tensor:
        param = nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16), requires_grad=False)
        rounding = Rounding(seed, {id(param): name})
        rounding.step = step
        rounding.round_into_(param, torch.full((4096,), 1 + 2**-8))  # halfway: a coin each
        return param.detach().clone()

    first = bits(0, 1, "w")
    assert torch.equal(first, bits(0, 1, "w"))  # another tensor of the same name
    for other in (bits(1, 1, "w"), bits(0, 2, "w"), bits(0, 1, "v")):
        assert not torch.equal(first, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_tensor_steps_in_chunks_as_it_would_whole(monkeypatch, dtype):
    """Stepped ``CHUNK`` elements at a time (here 1,000 of 10,000, and a ragged last chunk),
    the weights and moments are bitwise those of one piece: on CPU the bits drawn chunk after
    chunk from one seeded generator are those drawn at once."""
    torch.manual_seed(0)
    weight, grads = torch.randn(10_001), [torch.randn(10_001) for _ in range(3)]

    def steps(chunk: int) -> list[torch.Tensor]:
        monkeypatch.setattr(stochastic_rounding, "CHUNK", chunk)
        param = nn.Parameter(weight.to(dtype))
        optimizer = RoundedAdamW([param], Rounding(0, {id(param): "w"}), lr=1e-2, weight_decay=0.1)
        for grad in grads:
            param.grad = grad.to(dtype)
            optimizer.step()
        state = optimizer.state[param]
        return [param.detach(), state["exp_avg"], state["exp_avg_sq"]]

    whole, chunked = steps(1 << 22), steps(1000)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))


def test_shards_draw_their_own_bits_and_replicas_the_same(monkeypatch):
    """The key holds the parameter's coordinates on its sharded mesh dimensions only: two
    shards of one parameter round independently, two replicas alike (a 1-rank mesh whose
    coordinate is set by hand stands for the ranks)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))

        def bits(placements: list, coordinate: list[int]) -> torch.Tensor:
            param = distribute_tensor(torch.zeros(4096, dtype=torch.bfloat16), mesh, placements)
            rounding = Rounding(0, {id(param): "w"})
            with monkeypatch.context() as patch:
                patch.setattr(type(mesh), "get_coordinate", lambda self: coordinate)
                rounding.round_into_(param, torch.full((4096,), 1 + 2**-8))  # a coin each
            return param.to_local().clone()

        sharded, replicated = [Shard(0), Replicate()], [Replicate(), Replicate()]
        assert not torch.equal(bits(sharded, [0, 0]), bits(sharded, [1, 0]))  # two shards
        assert torch.equal(bits(sharded, [0, 0]), bits(sharded, [0, 1]))  # tp replicas
        assert torch.equal(bits(replicated, [0, 0]), bits(replicated, [1, 1]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("rounded", "plain"), [(RoundedAdamW, torch.optim.AdamW), (RoundedAdam, torch.optim.Adam)]
)
def test_the_float32_step_is_torchs(rounded, plain):
    """On float32 weights nothing is rounded: the step is torch's fused Adam(W)'s."""
    torch.manual_seed(0)
    mine, theirs = nn.Parameter(torch.randn(64, 32)), nn.Parameter(torch.randn(64, 32))
    theirs.data.copy_(mine.data)
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    ours = rounded([mine], rounding=Rounding(0, {}), **settings)
    reference = plain([theirs], **settings)
    for _ in range(5):
        mine.grad, theirs.grad = (g := torch.randn(64, 32)), g.clone()
        ours.step()
        reference.step()
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(ours.state[mine][key], reference.state[theirs][key])
    # The same state: a checkpoint moves between runs with and without rounding.
    reference.load_state_dict(ours.state_dict())


def test_bf16_weights_land_next_to_the_float32_step():
    """Each new bf16 weight is one of the two bf16 values around the step torch computes
    from the same bf16 weights and moments."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(256, 64).bfloat16())
    shadow = nn.Parameter(weight.detach().float())
    settings = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = RoundedAdamW([weight], rounding=Rounding(0, {id(weight): "w"}), **settings)
    reference = torch.optim.AdamW([shadow], **settings)
    for step in range(1, 4):
        gradient = torch.randn(256, 64).bfloat16()
        shadow.data.copy_(weight.detach().float())
        if step > 1:  # the moments as ours holds them (bf16)
            for key in ("exp_avg", "exp_avg_sq"):
                reference.state[shadow][key].copy_(ours.state[weight][key].float())
        weight.grad, shadow.grad = gradient, gradient.float()
        ours.rounding.step = step
        ours.step()
        reference.step()
        low = shadow.detach().bfloat16().float()
        spacing = (low.bfloat16().view(torch.int16) + 1).view(torch.bfloat16).float() - low
        off = (weight.detach().float() - shadow.detach()).abs()
        assert (off <= spacing.abs() * 1.0001).all()
        assert (weight.detach().float() != low).any()  # some rounded the other way


def test_updates_below_half_a_bf16_step_add_up_in_expectation():
    """Rounding to nearest drops a step of 1e-4 from 1.0 (bf16's spacing there is 2^-8):
    the weights never move. Rounded at random they move by 1e-4 a step on average."""
    settings = dict(lr=1e-4, weight_decay=0.0, fused=True)
    nearest = nn.Parameter(torch.ones(100_000, dtype=torch.bfloat16))
    random = nn.Parameter(torch.ones(100_000, dtype=torch.bfloat16))
    plain = torch.optim.AdamW([nearest], **settings)
    rounded = RoundedAdamW([random], rounding=Rounding(0, {id(random): "w"}), **settings)
    for step in range(1, 101):
        nearest.grad, random.grad = torch.ones_like(nearest), torch.ones_like(random)
        plain.step()
        rounded.rounding.step = step
        rounded.step()
    assert torch.equal(nearest, torch.ones_like(nearest))
    # 1 - 100 x 1e-4, up to the bf16 moments' own rounding (measured: 0.99009-0.99014)
    assert random.float().mean().item() == pytest.approx(0.99, abs=3e-4)


def test_muon_rounds_its_matrices_and_adamw_the_rest():
    """Through the optimizer builder: Muon's matrices (steps of about 2.5e-6) and AdamW's
    norm (1e-4) move by updates that rounding to nearest drops."""

    def built() -> nn.Module:  # Muon takes the matrices under ``layers.``
        layers = nn.ModuleList([nn.Linear(64, 64, bias=False)])
        return nn.ModuleDict({"layers": layers, "norm": nn.LayerNorm(64, bias=False)})

    model = built().to(torch.bfloat16)
    with torch.no_grad():  # |w| in [0.25, 0.5): bf16's spacing is 2^-9 throughout
        matrix = model["layers"][0].weight
        matrix.copy_((0.25 + torch.rand(64, 64) / 4) * torch.randn(64, 64).sign())

    def trained(rounding: bool) -> nn.Module:
        copy = built().to(torch.bfloat16)
        copy.load_state_dict(model.state_dict())
        config = OptimizerConfig(
            name="Muon", lr=1e-4, weight_decay=0.0, stochastic_rounding=rounding
        )
        optimizers = build_optimizers([copy], config, torch.device("cpu"), seed=0)
        kinds = {type(o) for o in optimizers.optimizers}
        assert kinds == ({Muon, RoundedAdamW} if rounding else {Muon, torch.optim.AdamW})
        for step in range(1, 21):
            for p in copy.parameters():
                p.grad = torch.ones_like(p)
            optimizers.step(step)
        return copy

    nearest, random = trained(False), trained(True)
    for name, before in model.state_dict().items():
        assert torch.equal(nearest.state_dict()[name], before), name
        assert not torch.equal(random.state_dict()[name], before), name
    # The norm's weights, 1.0: AdamW's 20 steps of 1e-4 (half a bf16 step is 2^-9 there);
    # their mean's standard deviation is about 3.5e-4.
    norm = random["norm"].weight.float().mean().item()
    assert norm == pytest.approx(1 - 20 * 1e-4, abs=1.5e-3)


def test_the_step_runs_on_a_dry_runs_fake_tensors():
    """COMM_MODE=fake_backend probes a step on fake tensors: nothing may read a value."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        weight = nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
        optimizer = RoundedAdamW([weight], rounding=Rounding(0, {}), lr=1e-3, fused=True)
        weight.grad = torch.ones_like(weight)
        optimizer.step()

"""Which linear layers train in float8 (``--float8.filter_fqns`` and CUDA's 16-alignment), how
FSDP and TP move them over gloo."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from torchtitan.components import float8
from torchtitan.components.float8 import (
    after_sharding,
    apply_float8,
    float8_gathered,
    is_float8,
    scalar_cpu_kernels,
    tp_in_float8,
    tp_style,
    wanted,
)
from torchtitan.components.optimizer import Optimizers
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Float8 as Float8Config
from torchtitan.tools.versions import torch_version


def test_filter_keeps_named_and_unaligned_linears_in_high_precision():
    filters = ["output"]
    assert wanted(nn.Linear(256, 512), "layers.0.attention.wq", filter_fqns=filters)
    assert not wanted(nn.Linear(256, 2048), "output", filter_fqns=filters)
    assert not wanted(nn.Linear(256, 8), "layers.1.moe.router.gate", filter_fqns=filters)
    # A router of 128 experts is aligned: the default filter keeps it in high precision.
    default = Float8Config().filter_fqns
    assert wanted(nn.Linear(256, 128), "layers.1.moe.router.gate", filter_fqns=filters)
    assert not wanted(nn.Linear(256, 128), "layers.1.moe.router.gate", filter_fqns=default)
    assert wanted(nn.Linear(256, 512), "layers.0.moe.shared_experts.w1", filter_fqns=default)
    assert not wanted(nn.Linear(24, 256), "layers.0.feed_forward.w2", filter_fqns=filters)
    assert not wanted(nn.Embedding(10, 16), "tok_embeddings", filter_fqns=filters)


@pytest.fixture(scope="module")
def gloo_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _float8_model(*, with_norm: bool) -> nn.Module:
    block = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False))
    if with_norm:
        block.append(nn.RMSNorm(16))
    model = nn.Sequential(block)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    return model


@pytest.mark.parametrize("with_norm", [True, False])
def test_gloo_gathers_float8_units_only_mixed_with_high_precision(gloo_mesh, with_norm):
    """FSDP sends a unit whose inputs mix dtypes as bytes, which gloo moves; a unit of float8
    weights alone would go as float8 and is refused in one line before the first step."""
    model = _float8_model(with_norm=with_norm)
    fully_shard(model[0], mesh=gloo_mesh)
    fully_shard(model, mesh=gloo_mesh)
    config = Float8Config(enable=True, enable_fsdp_float8_all_gather=True)
    optimizers = Optimizers([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    if not with_norm:
        with pytest.raises(ConfigError, match="unit '0' holds only float8 weights"):
            after_sharding([model], optimizers, config)
        return
    after_sharding([model], optimizers, config)
    model(torch.randn(4, 16)).sum().backward()  # gathered over gloo
    weights = [p for p in model.parameters() if float8_gathered(p)]
    assert len(weights) == 2
    optimizers.step()  # the hook precomputes each weight's scale from the new values
    for linear in model[0][:2]:
        local = linear.weight._local_tensor
        want = torch.finfo(torch.float8_e4m3fn).max / local._tensor.abs().max().double()
        assert local._precomputed_scale.item() == pytest.approx(want.item(), rel=1e-6)


def test_tp_styles_are_float8_only_for_float8_linears():
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        PrepareFloat8ModuleInput,
    )

    model = _float8_model(with_norm=False)
    float8_linear, plain = model[0][0], nn.Linear(16, 16)
    assert is_float8(float8_linear) and not is_float8(plain)
    assert type(tp_style(ColwiseParallel, [float8_linear], float8=True)) is Float8ColwiseParallel
    assert type(tp_style(ColwiseParallel, [float8_linear], float8=False)) is ColwiseParallel
    assert type(tp_style(RowwiseParallel, [plain], float8=True)) is RowwiseParallel
    prepare = tp_style(PrepareModuleInput, [float8_linear, plain], float8=True)
    assert type(prepare) is PrepareModuleInput  # a plain consumer needs a plain input
    prepare = tp_style(PrepareModuleInput, [float8_linear], float8=True)
    assert type(prepare) is PrepareFloat8ModuleInput


@pytest.mark.parametrize(
    ("recipe", "sequence_parallel", "float8_styles"),
    [("tensorwise", False, True), ("tensorwise", True, False), ("rowwise", False, False)],
)
def test_tp_moves_float8_activations_only_where_gloo_need_not(
    gloo_mesh, recipe, sequence_parallel, float8_styles
):
    config = Float8Config(enable=True, recipe_name=recipe)
    assert tp_in_float8(config, gloo_mesh, sequence_parallel=sequence_parallel) is float8_styles


def test_scales_precomputed_per_mesh_before_the_first_forward_and_after_each_step(gloo_mesh):
    """Under TP some float8 weights are sharded over data and TP ranks, others over the data
    ranks only (a linear without a TP style); torchao's precompute takes one mesh, so scales
    are computed per mesh, first before the first forward (after a checkpoint would load)."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = _float8_model(with_norm=True)
    parallelize_module(model[0], mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    extra = nn.Sequential(nn.Linear(16, 16, bias=False))  # no TP style: on the data mesh only
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(extra, config=config)
    model[0].append(extra[0])
    fully_shard(model[0], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    meshes = {linear.weight.device_mesh.ndim for linear in (model[0][0], model[0][3])}
    assert meshes == {1, 2}
    optimizers = Optimizers([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    after_sharding(
        [model], optimizers, Float8Config(enable=True, enable_fsdp_float8_all_gather=True)
    )
    float8_linears = [model[0][0], model[0][1], model[0][3]]
    assert all(m.weight._local_tensor._precomputed_scale is None for m in float8_linears)
    model(torch.randn(4, 16)).sum().backward()
    before = [m.weight._local_tensor._precomputed_scale.item() for m in float8_linears]
    optimizers.step()
    after = [m.weight._local_tensor._precomputed_scale.item() for m in float8_linears]
    assert before != after
    for linear, scale in zip(float8_linears, after, strict=True):
        weight = linear.weight.full_tensor()
        want = torch.finfo(torch.float8_e4m3fn).max / weight.abs().max().double()
        assert scale == pytest.approx(want.item(), rel=1e-6)


def test_the_float8_all_gather_flag_says_when_nothing_gathers(caplog):
    model = _float8_model(with_norm=True)  # no FSDP
    optimizers = Optimizers([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    config = Float8Config(enable=True, enable_fsdp_float8_all_gather=True)
    with caplog.at_level("WARNING"):
        after_sharding([model], optimizers, config)
    assert "does nothing here" in caplog.text
    assert not optimizers._post_step_hooks


@pytest.mark.parametrize("float8_styles", [True, False])
def test_llama3_tp_plan_feeds_float8_linears_float8_inputs(gloo_mesh, float8_styles):
    """With the float8 styles each region's input is cast to float8 before it reaches (or is
    gathered for) the linears; without them the linears get high-precision inputs."""
    from torchtitan.models.llama3.args import Llama3Args
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.parallelize import apply_tp

    args = Llama3Args(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16)
    model = Transformer(args)
    model.init_weights()
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "output")
    apply_tp(
        model, gloo_mesh, loss_parallel=False, sequence_parallel=False, float8_styles=float8_styles
    )
    seen = {}

    def record(name):
        def hook(module, inputs):
            x = inputs[0]
            seen[name] = type(getattr(x, "_local_tensor", x)).__name__

        return hook

    block = model.layers["0"]
    for name in ("attention.wq", "feed_forward.w1", "feed_forward.w2"):
        block.get_submodule(name).register_forward_pre_hook(record(name))  # after the style
    model(torch.randint(0, 128, (2, 16)))
    kind = "Float8TrainingTensor" if float8_styles else "Tensor"
    assert seen == {name: kind for name in seen} and len(seen) == 3


class _SharedInput(nn.Module):
    """The smallest case of the CPU kernel bug: two float8 linears reading one bf16 input."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(256)
        self.a, self.b = nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.a(h) + self.b(h)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU kernel workaround")
def test_compiled_float8_in_bf16_on_cpu_keeps_finite_weight_gradients():
    """With torch 2.13's vectorized CPU kernels both weights' gradients are NaN; with the
    scalar kernels ``scalar_cpu_kernels`` picks they are as close to float32's as eager
    float8's are (2.4% here, in norm)."""
    import torch._inductor.config as inductor

    saved = inductor.cpp.simdlen  # a process-wide setting: put back for later tests
    inductor.cpp.simdlen = None
    torch._dynamo.reset()
    try:
        scalar_cpu_kernels()
        assert inductor.cpp.simdlen == (0 if torch_version() >= (2, 12) else None)
        torch.manual_seed(0)
        model, reference = _SharedInput(), _SharedInput()
        reference.load_state_dict(model.state_dict())
        convert_to_float8_training(model, config=Float8LinearConfig())
        model = model.to(torch.bfloat16)
        x = torch.randn(2, 256, 256)
        reference(x).sum().backward()
        torch.compile(model)(x.bfloat16()).float().sum().backward()
    finally:
        inductor.cpp.simdlen = saved
        torch._dynamo.reset()
    for name in ("a", "b"):
        grad = getattr(model, name).weight.grad.float()
        expected = getattr(reference, name).weight.grad
        assert torch.isfinite(grad).all(), name
        assert (grad - expected).norm() / expected.norm() < 0.05, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's float8 matmul")
def test_row_wise_recipes_are_refused_where_the_cpu_matmul_takes_tensor_scales_only(monkeypatch):
    """torch 2.11's CPU ``_scaled_mm`` asserts that both scales are single numbers: the
    row-wise recipes are refused in one line there (emulated they run); 2.13 takes them."""
    monkeypatch.setattr(float8, "cpu_takes_row_scales", lambda: False)
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        with pytest.raises(ConfigError, match=f"recipe_name {recipe}: torch .* per-tensor scales"):
            apply_float8(model, Float8Config(recipe_name=recipe), autocast=False)
    apply_float8(model, Float8Config(recipe_name="tensorwise"), autocast=False)
    emulated = nn.Sequential(nn.Linear(32, 32, bias=False))
    apply_float8(emulated, Float8Config(recipe_name="rowwise", emulate=True), autocast=False)
    assert is_float8(emulated[0])


def test_the_row_scale_probe_answers_for_this_torch():
    if torch_version() >= (2, 13):
        assert float8.cpu_takes_row_scales()
    elif torch_version() < (2, 12):
        assert not float8.cpu_takes_row_scales()

"""Which linear layers train in float8 (``--float8.filter_fqns`` and CUDA's 16-alignment), how
FSDP and TP move them over gloo."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from torchtitan.components.float8 import (
    after_sharding,
    float8_gathered,
    is_float8,
    tp_in_float8,
    tp_style,
    wanted,
)
from torchtitan.components.optimizer import Optimizers
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Float8 as Float8Config


def test_filter_keeps_named_and_unaligned_linears_in_high_precision():
    filters = ["output"]
    assert wanted(nn.Linear(256, 512), "layers.0.attention.wq", filter_fqns=filters)
    assert not wanted(nn.Linear(256, 2048), "output", filter_fqns=filters)
    assert not wanted(nn.Linear(256, 8), "layers.1.moe.router.gate", filter_fqns=filters)
    assert not wanted(nn.Linear(24, 256), "layers.0.feed_forward.w2", filter_fqns=filters)
    assert not wanted(nn.Embedding(10, 16), "tok_embeddings", filter_fqns=filters)


@pytest.fixture(scope="module")
def gloo_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _float8_model(*, with_norm: bool) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

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

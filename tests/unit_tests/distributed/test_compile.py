"""Which parts of a mixture-of-experts block compile (``apply_compile_around``), looked at
through activation checkpointing. That the compiled model trains as the eager one does:
``test_parallel_numerics.py``'s ``moe_ep2_compile_ac``."""

import dataclasses

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import ActivationCheckpoint, Compile
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile_around
from torchtitan.distributed.compile import backend as compile_backend
from torchtitan.models.common.experts import GroupedExperts
from torchtitan.models.common.moe import MoE
from torchtitan.models.deepseek_v3 import flavors
from torchtitan.models.deepseek_v3.model import Transformer


def _eager(module: nn.Module) -> bool:
    return isinstance(module, (MoE, GroupedExperts))


def _debug_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(flavors["debugmodel"], max_seq_len=16))
    model.init_weights()
    return model


def test_moe_blocks_compile_all_but_the_routed_experts_through_checkpointing():
    model = _debug_model()
    apply_ac(model.layers, ActivationCheckpoint(mode="full"))
    moe_name = next(n for n, b in model.layers.items() if b._checkpoint_wrapped_module.moe_enabled)
    block = model.layers[moe_name]
    apply_compile_around(block, Compile(enable=True), eager=_eager)
    inner = block._checkpoint_wrapped_module
    for name in ("attention_norm", "attention", "ffn_norm"):
        assert isinstance(getattr(inner, name), OptimizedModule), name
    assert type(inner.moe) is MoE
    assert isinstance(inner.moe.router, OptimizedModule)
    assert isinstance(inner.moe.shared_experts, OptimizedModule)
    assert type(inner.moe.experts) is GroupedExperts


def test_a_backend_torch_compile_lacks_is_refused_in_one_line():
    assert compile_backend(Compile(backend="aot_eager")) == "aot_eager"
    with pytest.raises(ConfigError) as refused:
        apply_compile_around(
            nn.Sequential(nn.Linear(2, 2)), Compile(backend="eager2"), eager=_eager
        )
    message = str(refused.value)
    assert message.startswith(
        "--compile.backend eager2 is not a torch.compile backend here; use inductor (the "
        "default), eager or aot_eager to debug, or one of "
    )
    assert "cudagraphs" in message and "\n" not in message

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


def _saved_activation_bytes(memory_budget: float | None) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes the compiled blocks of a Llama 3 debug model keep for backward (parameters not
    counted), and the gradients, under ``--activation_checkpoint.mode memory_budget``'s
    wiring (``apply_ac`` leaves the blocks alone; ``apply_compile`` sets the budget). The
    partitioner is the one inductor uses (min-cut), without inductor's C++ compile."""
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.llama3 import flavors as llama3_flavors
    from torchtitan.models.llama3.model import Transformer as Llama3

    torch._dynamo.reset()  # graphs compiled under another budget are not reused
    torch.manual_seed(0)
    model = Llama3(dataclasses.replace(llama3_flavors["debugmodel"], max_seq_len=64))
    model.init_weights()
    mode = "none" if memory_budget is None else "memory_budget"
    apply_ac(model.layers, ActivationCheckpoint(mode=mode))
    assert not any(hasattr(b, "_checkpoint_wrapped_module") for b in model.layers.values())
    apply_compile(
        model.layers, Compile(enable=True, backend="aot_eager_decomp_partition"),
        memory_budget=memory_budget,
    )  # fmt: skip
    weights = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:
            saved.append(t.numel() * t.element_size())
        return t

    tokens = torch.randint(0, model.args.vocab_size, (2, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return sum(saved), {n: p.grad for n, p in model.named_parameters()}


def test_a_memory_budget_trades_kept_activations_for_recomputation_with_the_same_gradients():
    """Budget 1 keeps what compile keeps without checkpointing; 0.5 about half of the
    blocks' share; 0 little more than each block's input; the gradients do not change."""
    free, grads = _saved_activation_bytes(None)
    everything, grads_1 = _saved_activation_bytes(1.0)
    half, grads_half = _saved_activation_bytes(0.5)
    least, grads_0 = _saved_activation_bytes(0.0)
    assert everything == free
    assert least < half < everything
    outside = least  # the embedding's, the output's and each block's input are kept anyway
    assert half - outside < 0.7 * (everything - outside)
    for other in (grads_1, grads_half, grads_0):
        for name, grad in grads.items():
            torch.testing.assert_close(other[name], grad, rtol=1e-5, atol=1e-6, msg=name)

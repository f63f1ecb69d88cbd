"""Activation checkpointing recomputes what each mode says, and changes no numbers."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.config.manager import parse_args
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.args import Llama3Args
from torchtitan.models.llama3.model import Transformer

ARGS = Llama3Args(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=101, max_seq_len=16)
LINEARS_PER_BLOCK = 7  # wq wk wv wo w1 w3 w2


class _MatmulCounter(TorchDispatchMode):
    """Counts matmuls that actually execute (outputs replayed from a checkpoint cache don't)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    with torch.no_grad():
        model.init_weights()
    return model


def _backward(mode: str, option: str = "2") -> tuple[int, dict[str, torch.Tensor]]:
    """Matmuls run during backward, and the gradients."""
    model = _model()
    apply_ac(model.layers, ActivationCheckpoint(mode=mode, selective_ac_option=option))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(tokens).float().logsumexp(-1).mean()
    counter = _MatmulCounter()
    with counter:
        loss.backward()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()
    }
    return counter.count, grads


def test_each_mode_recomputes_the_matmuls_it_should_and_keeps_gradients():
    base, base_grads = _backward("none")
    recomputed = {
        "full": _backward("full")[0] - base,
        "every 2nd block": _backward("selective", "2")[0] - base,
        "ops": _backward("selective", "op")[0] - base,
    }
    # A replayed forward stops early once backward has what it needs: the last matmul's (w2)
    # output is never needed, so a fully checkpointed block recomputes 6 of its 7 matmuls.
    replayed = LINEARS_PER_BLOCK - 1
    assert recomputed == {
        "full": 4 * replayed,  # every block
        "every 2nd block": 2 * replayed,  # blocks 0 and 2
        "ops": 4 * 3,  # every second matmul of each block (wk, wo, w3); attention is kept
    }
    for mode, option in (("full", "2"), ("selective", "2"), ("selective", "op")):
        _, grads = _backward(mode, option)
        for name, grad in base_grads.items():
            torch.testing.assert_close(
                grads[name], grad, rtol=1e-5, atol=1e-7, msg=f"{mode} {name}"
            )


def test_debug_options_reach_the_checkpoint():
    model = _model()
    config = ActivationCheckpoint(
        mode="full", preserve_rng_state=True, determinism_check="none", debug=True
    )
    apply_ac(model.layers, config)
    options = model.layers["0"].checkpoint_fn.keywords
    assert options["preserve_rng_state"] is True
    assert options["determinism_check"] == "none"
    assert options["debug"] is True


@pytest.mark.parametrize("option", ["0", "-1", "ops", ""])
def test_bad_selective_option_names_the_flag(option):
    # A pre-flight rule: refused while the config is parsed, before any rank builds a model.
    flags = ["--activation_checkpoint.mode", "selective"]
    with pytest.raises(ConfigError, match="--activation_checkpoint.selective_ac_option"):
        parse_args([*flags, f"--activation_checkpoint.selective_ac_option={option}"])

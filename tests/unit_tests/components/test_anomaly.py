"""``--debug.detect_anomaly``: the watch over a step names where the first NaN/inf came from."""

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.distributed._local_tensor import LocalTensor

from torchtitan.components import anomaly
from torchtitan.components.train_state import NonFiniteError
from torchtitan.distributed import local_tensor


class _Scaled(nn.Module):
    """Two linear layers with an op of the parent's own between them and after them."""

    def __init__(self, between: float = 1.0, after=None):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.between, self.after = between, after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x) * self.between
        h = self.second(h)
        return self.after(h) if self.after is not None else h


def _step(model: nn.Module, x: torch.Tensor, *, per_op: bool = True, last=lambda: "ckpt/step-4"):
    with anomaly.watch([model], step=5, rank=3, per_op=per_op, last_checkpoint=last):
        model(x).sum().backward()


def _error(model: nn.Module, x: torch.Tensor, *, per_op: bool = True) -> str:
    with pytest.raises(NonFiniteError) as e:
        _step(model, x, per_op=per_op)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    return str(e.value)


def _hooked(model: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_finite_step_passes_and_leaves_no_hook_or_mode():
    model = _Scaled()
    seen = []

    def check(*args):
        seen.append(torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled())

    model.second.register_forward_hook(check)  # the model's own hook, which stays
    _step(model, torch.randn(2, 4))
    assert seen == [True]  # anomaly mode was on during the step, and is off after it
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert len(model.second._forward_hooks) == 1 and not model.first._forward_hooks
    assert not model._forward_pre_hooks and not torch.is_anomaly_enabled()


def test_a_stopped_step_leaves_no_hook_or_mode_either():
    _error(_SqrtOfZero(), torch.ones(2, 4))
    model = _Scaled(between=float("nan"))
    _error(model, torch.ones(2, 4))
    assert not _hooked(model) and not torch.is_anomaly_enabled()


def test_a_mode_turned_on_outside_stays_on():
    with torch.autograd.set_detect_anomaly(True):
        _step(_Scaled(), torch.ones(2, 4), per_op=True)
        assert torch.is_anomaly_enabled()


class _Router(nn.Module):
    """Returns integer indices and scores beside its output, as an MoE router does; its
    masked scores hold -inf only inside its forward."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        scores = self.gate(x).masked_fill(torch.eye(4, dtype=torch.bool)[:2], float("-inf"))
        top = scores.topk(2, dim=-1)
        return x * top.values.sum(-1, keepdim=True).sigmoid(), top.indices, None


def test_integer_and_empty_outputs_are_not_checked():
    router = _Router()
    with anomaly.watch([router], step=1, rank=0, per_op=True, last_checkpoint=lambda: None):
        out, indices, _ = router(torch.ones(2, 4))
        out.sum().backward()
    assert indices.dtype == torch.int64


def test_module_names_skip_activation_checkpointing_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(nn.Linear(4, 4), checkpoint_wrapper(_SqrtAfterLinear()))
    message = _error(model, torch.ones(2, 4), per_op=False)
    assert "the gradient reaching the output of 1.linear (Linear) holds nan" in message, message
    assert "(the last gradient found finite reached 1 (_SqrtAfterLinear))" in message, message


def test_a_finding_wrapped_by_a_pipeline_schedule_is_named_and_its_log_dropped(caplog):
    schedules = logging.getLogger("torch.distributed.pipelining.schedules")

    class Wraps(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _Scaled(between=float("inf"))

        def forward(self, x):
            try:
                return self.inner(x)
            except Exception as e:  # as torch's pipelining stages and schedules do
                schedules.error("caught %s; the timetable follows", e)
                raise RuntimeError("Failed to run stage forward") from e

    with caplog.at_level(logging.ERROR, logger=schedules.name):
        message = _error(Wraps(), torch.ones(2, 4))
        schedules.error("after the step")
    assert "inner.second (Linear) got inf in its input" in message, message
    assert [r.getMessage() for r in caplog.records] == ["after the step"]


def test_the_gradient_norm_line_says_what_was_checked():
    line = str(
        NonFiniteError.at_step(3, float("inf"), 0, 2.5, None, checked=anomaly.checked(False))
    )
    assert (
        "(--debug.detect_anomaly checked every module's output and the gradient reaching it "
        "for NaN/inf and found none: a parameter's gradient, its reduction or the norm "
        "overflowed)"
    ) in line, line
    line = str(NonFiniteError.at_step(3, float("nan"), 0, 2.5, "ckpt/step-2"))
    assert "; --debug.detect_anomaly finds the module where it starts;" in line, line


def test_weights_that_blew_up_are_named_with_their_size():
    model = _Scaled()
    with torch.no_grad():
        model.first.weight.fill_(1.0)
        model.first.bias.fill_(1.0)
        model.second.weight.fill_(3e38)  # 4 x 5 x 3e38 overflows
    message = _error(model, torch.ones(2, 4))
    assert message.startswith(
        "step 5, rank 3: second (Linear) turned finite inputs into inf in its forward; of its "
        "own, the largest parameter value is 3e+38 (in weight); last good checkpoint: "
        "ckpt/step-4. Lower --optimizer.lr"
    ), message


def test_a_nan_weight_is_named():
    model = _Scaled()
    with torch.no_grad():
        model.first.bias[1] = float("nan")
    message = _error(model, torch.ones(2, 4))
    assert "first (Linear) turned finite inputs into nan" in message, message
    assert "of its own, bias holds non-finite values" in message, message


def test_an_op_between_modules_is_told_apart_from_the_module_that_receives_it():
    message = _error(_Scaled(between=float("inf")), torch.ones(2, 4))
    assert "second (Linear) got inf in its input, made by an op outside any module" in message


def test_an_op_of_a_container_after_its_finite_submodules_names_the_container():
    message = _error(_Scaled(after=lambda h: (h.abs() + 100).exp()), torch.ones(2, 4))
    assert (
        "the model (_Scaled) turned finite inputs into inf in its forward (its submodules' "
        "outputs were finite: an op of its own made it)"
    ) in message, message


class _SqrtOfZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale * 0).sqrt()  # finite forward, NaN gradient


def test_a_backward_nan_names_the_function_and_its_forward_line():
    message = _error(_SqrtOfZero(), torch.ones(2, 4))
    assert message.startswith("step 5, rank 3: the backward of MulBackward0 returned nan"), message
    assert "its forward: tests/unit_tests/components/test_anomaly.py:" in message, message
    assert "(return (x * self.scale * 0).sqrt()" in message, message
    assert "in this rank's model, the largest parameter value is 2 (in scale)" in message


class _SqrtAfterLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) * 0).sqrt()


def test_without_per_op_checks_the_gradient_reaching_a_module_is_checked():
    """Where autograd's check cannot read the gradients (DTensor ones), the module whose
    output receives the first non-finite gradient is named."""
    message = _error(_SqrtAfterLinear(), torch.ones(2, 4), per_op=False)
    assert message.startswith(
        "step 5, rank 3: the gradient reaching the output of linear (Linear) holds nan, made in "
        "the backward of what uses that output"
    ), message


def test_each_micro_batch_backward_starts_afresh():
    """A NaN in the first gradient of the second backward names no module of the first."""
    model = _Scaled()
    with pytest.raises(NonFiniteError) as e:
        with anomaly.watch([model], step=5, rank=3, per_op=False, last_checkpoint=lambda: None):
            model(torch.ones(2, 4)).sum().backward()
            (model(torch.ones(2, 4)) * 0).sqrt().sum().backward()  # the loss's backward: NaN
    message = str(e.value)
    # second's output is the model's too: the inner name is given
    assert "the gradient reaching the output of second (Linear) holds nan, made in the " in message
    assert "backward of what uses that output; in this rank's model" in message, message


def test_other_errors_pass_through_and_other_warnings_are_still_shown():
    class Warns(nn.Linear):
        def forward(self, x):
            warnings.warn("a warning of the model's own", UserWarning, stacklevel=2)
            return super().forward(x)

    with pytest.warns(UserWarning, match="a warning of the model's own"):
        _step(Warns(4, 4), torch.ones(1, 4))
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        _step(nn.Linear(4, 4), torch.ones(1, 3))


def test_the_models_own_input_is_named_as_such():
    message = _error(_Scaled(), torch.full((2, 4), float("nan")))
    assert "step 5, rank 3: the input of the model (_Scaled) holds nan (from the data or the " in (
        message
    ), message


def test_a_simulated_rank_is_named_by_its_own_value():
    with local_tensor.local_tensor_mode(2):
        model = _Scaled()
        with torch.no_grad():
            model.first.weight.fill_(1.0)
        with local_tensor.host_only():
            x = LocalTensor({0: torch.ones(2, 4), 1: torch.full((2, 4), 3e38)})
        message = _error(model, x)
    assert message.startswith("step 5, rank 1: first (Linear) turned finite inputs into inf")

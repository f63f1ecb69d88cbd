"""``--debug.detect_anomaly``: where a step first goes NaN or infinite, named in one line.

A non-finite gradient norm says that a step went wrong, not where. This mode watches the step
and stops at the first non-finite value, with a :class:`NonFiniteError` (exit 3) that names it:

- **forward**: every module's output is checked as it returns. Modules return in post-order (a
  block after its layers), so the first non-finite output belongs to the innermost module
  that made it. Finite inputs mean one of its own ops made it: its parameters' largest
  magnitude tells weights that blew up from an op that overflowed. Non-finite inputs mean an
  op outside any module made them (a residual add in the parent's forward).
- **backward, per op**: autograd's anomaly mode (``check_nan``) stops at the first backward
  function that returns NaN; its forward's traceback, which torch emits as a warning, gives the
  model's line. Torch's check cannot read a DTensor gradient (no sharding rule for
  ``aten._is_any_true``), so runs whose activations are DTensors (tensor or context
  parallel) go without it.
- **backward, per module**: the gradient reaching each module's output is checked as it
  arrives; the first non-finite one was made by the backward of what consumes that output.

Each check reads a value on the host (a device sync per module): a debugging rerun from the
last good checkpoint, several times slower than training. Values are checked per rank
(a DTensor's local shard, every simulated rank's value under ``COMM_MODE=local_tensor``): the
rank that finds it stops, and the launcher stops the others.
"""

import contextlib
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.components.train_state import NonFiniteError
from torchtitan.distributed import local_tensor
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.logging import logger
from torchtitan.tools.module_names import clean_name

_BACKWARD_NAN = re.compile(r"Function '(\w+)' returned nan values in its (\d+)th output")
_FORWARD_TRACE = "Traceback of forward call that caused the error"
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_T = TypeVar("_T", bound=BaseException)


def start(*, per_op: bool) -> None:
    """Turn autograd's anomaly mode (with its NaN check of every backward function's output)
    on for the whole process where it can read the gradients (``per_op_checks``): a
    process-wide switch, which simulated pipeline ranks (threads) share rather than toggle."""
    logger.info(
        f"--debug.detect_anomaly: every module's output and gradient"
        f"{' and every backward op' if per_op else ''} is checked for NaN/inf (a host read "
        "each: slower steps)"
    )
    if per_op:
        torch.autograd.set_detect_anomaly(True, check_nan=True)


def stop() -> None:
    torch.autograd.set_detect_anomaly(False)


def per_op_checks(dims: ParallelDims, fsdp_impl: str) -> bool:
    """Whether autograd's per-op check can read this layout's gradients: not where the model
    computes with DTensors (tensor, context or expert parallel weights, DTensor-parametrized
    sharding); FSDP2 and replicated data parallel compute on plain tensors."""
    return not (dims.tp_enabled or dims.cp_enabled or dims.ep_enabled or fsdp_impl == "simple")


@contextlib.contextmanager
def watch(
    model_parts: Sequence[nn.Module],
    *,
    step: int,
    rank: int,
    last_checkpoint: Callable[[], object],
) -> Iterator[None]:
    """Check every module's output during the block (forward and backward of one step), and
    turn the first non-finite value found into a ``NonFiniteError`` naming where it began."""
    checks = _Checks()
    handles = [
        module.register_forward_hook(checks.output_check(name, module, part), with_kwargs=True)
        for part in model_parts
        for name, module in part.named_modules()
        if "parametrizations" not in name  # what computes a parameter, not the model
    ]
    handles += [
        part.register_forward_pre_hook(checks.input_check(part), with_kwargs=True)
        for part in model_parts
    ]
    # The forward traceback of a backward NaN comes as a warning; catching warnings swaps
    # process-wide state, which only the main thread may do (pipeline threads go without).
    capture = threading.current_thread() is threading.main_thread()
    caught: list[warnings.WarningMessage] = []
    try:
        try:
            with warnings.catch_warnings(record=True) if capture else contextlib.nullcontext() as w:
                if capture:
                    warnings.simplefilter("always")
                    caught = w
                yield
        finally:
            _replay(caught)  # once the filters are back
    except Exception as e:
        # Raised in a hook or by autograd, maybe wrapped on its way (a pipeline schedule).
        if (found := _in_chain(e, _Found)) is not None:
            what, where = found.what, found.rank if found.rank is not None else rank
        elif (what := _backward_nan(e, caught)) is not None:
            where = rank
        else:
            raise
        if found is None or found.backward:
            # Weights that blew up (a learning rate too high), or an op failing on sane ones.
            what += f"; in this rank's model, {_largest(_parameters(model_parts))}"
        raise NonFiniteError.located(step, where, what, last_checkpoint()) from None
    finally:
        for handle in handles:
            handle.remove()


class _Found(Exception):
    """Raised from a hook at the first non-finite value (turned into the error)."""

    def __init__(self, what: str, rank: int | None, *, backward: bool = False):
        super().__init__(what)
        self.what, self.rank, self.backward = what, rank, backward


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions it came from (a pipeline schedule wraps its stages')."""
    seen: BaseException | None = error
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def _in_chain(error: BaseException, kind: type[_T]) -> _T | None:
    return next((e for e in _chain(error) if isinstance(e, kind)), None)


class _Checks:
    """The hooks of one step, and what they have seen so far."""

    def __init__(self):
        self.last_finite_gradient: str | None = None
        """The module whose output's gradient was last found finite (backward order)."""

    def input_check(self, part: nn.Module) -> Callable:
        def hook(part: nn.Module, args: tuple, kwargs: dict) -> None:
            if (bad := _first_nonfinite((args, kwargs))) is not None:
                raise _Found(
                    f"the input of the model ({_class(part)}) holds {bad[0]} (from the data or "
                    "the previous pipeline stage)",
                    bad[1],
                )

        return hook

    def output_check(self, name: str, module: nn.Module, part: nn.Module) -> Callable:
        label = f"{clean_name(name)} ({_class(module)})" if name else f"the model ({_class(part)})"

        def gradient_check(grad: torch.Tensor) -> None:
            if (bad := _first_nonfinite(grad)) is None:
                self.last_finite_gradient = label
                return
            after = self.last_finite_gradient
            raise _Found(
                f"the gradient reaching the output of {label} holds {bad[0]}, made in the "
                "backward of what uses that output"
                + (f" (the last gradient found finite reached {after})" if after else ""),
                bad[1],
                backward=True,
            )

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            bad = _first_nonfinite(output)
            if bad is None:
                for leaf in pytree.tree_leaves(output):
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        leaf.register_hook(gradient_check)
                return
            kind, rank = bad
            given = _first_nonfinite((args, kwargs))
            if given is not None:
                what = (
                    f"{label} got {given[0]} in its input, made by an op outside any module (in "
                    "its parent's forward)"
                )
            else:
                what = f"{label} turned finite inputs into {kind} in its forward"
                own = list(module.named_parameters(recurse=False))
                if own:
                    what += f"; of its own, {_largest(own)}"
                elif any(True for _ in module.children()):
                    what += " (its submodules' outputs were finite: an op of its own made it)"
            raise _Found(what, rank)

        return hook


def _class(module: nn.Module) -> str:
    """The module's own class name, not the one that data parallelism gives it (FSDP2's
    ``FSDP<name>``, SimpleFSDP's ``SimpleFSDP<name>``, classes made in their modules)."""
    wrappers = ("torch.distributed.", "torchtitan.distributed.")
    return next(c for c in type(module).__mro__ if not c.__module__.startswith(wrappers)).__name__


def _first_nonfinite(tree: object) -> tuple[str, int | None] | None:
    """``("nan" | "inf", simulated rank or None)`` of the first floating tensor in ``tree``
    holding such a value on some rank; ``None`` when all are finite."""
    for leaf in pytree.tree_leaves(tree):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            continue
        local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
        with local_tensor.host_only():
            for rank, value in local_tensor.by_rank(local):
                if not bool(torch.isfinite(value).all()):
                    return ("nan" if bool(torch.isnan(value).any()) else "inf"), rank
    return None


def _largest(params: list[tuple[str, torch.Tensor]]) -> str:
    """What parameters hold: the first non-finite one, or the largest magnitude and where."""
    sizes = []
    for name, param in params:
        local = param.to_local() if isinstance(param, DTensor) else param
        with local_tensor.host_only():
            for _, value in local_tensor.by_rank(local.detach()):
                if not bool(torch.isfinite(value).all()):
                    return f"{clean_name(name)} holds non-finite values"
                if value.numel():
                    sizes.append((float(value.abs().max()), clean_name(name)))
    if not sizes:
        return "no parameter holds values"
    size, name = max(sizes)
    return f"the largest parameter value is {size:.3g} (in {name})"


def _parameters(model_parts: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    return [named for part in model_parts for named in part.named_parameters()]


def _backward_nan(error: BaseException, caught: list[warnings.WarningMessage]) -> str | None:
    """What anomaly mode's error (anywhere in the chain) says, with the model line of its
    forward; ``None`` for another error."""
    for e in _chain(error):
        if (match := _BACKWARD_NAN.search(str(e))) is not None:
            function, output = match.groups()
            what = f"the backward of {function} returned nan in its output {output}"
            line = _forward_line(caught)
            return what + (f"; its forward: {line}" if line else "")
    return None


def _forward_line(caught: list[warnings.WarningMessage]) -> str | None:
    """The innermost frame outside torch of the forward traceback anomaly mode warned with:
    ``path:line (code)``."""
    for message in reversed(caught):
        text = str(message.message)
        if _FORWARD_TRACE not in text:
            continue
        frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s+(.+)', text)
        ours = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
        if ours:
            path, line, code = ours[-1]
            return f"{os.path.relpath(path)}:{line} ({code.strip()})"
    return None


def _replay(caught: list[warnings.WarningMessage]) -> None:
    """Warnings of the step other than anomaly mode's own, shown as they would have been."""
    for w in caught:
        text = str(w.message)
        if _FORWARD_TRACE in text or text.startswith("Anomaly Detection has been enabled"):
            continue
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

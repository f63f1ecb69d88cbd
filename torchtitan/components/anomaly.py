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
  ``aten._is_any_true``) nor, simulated, a ``LocalTensor`` whose ranks differ, so such runs
  go without it (:func:`per_op_checks`).
- **backward, per module**: the gradient reaching each module's output is checked as it
  arrives; the first non-finite one was made by the backward of what consumes that output.

Each check reads a value on the host (a device sync per module): a debugging rerun from the
last good checkpoint, several times slower than training. Values are checked per rank
(a DTensor's local shard, every simulated rank's value under ``COMM_MODE=local_tensor``): the
rank that finds it stops, and the launcher stops the others.
"""

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.tensor import DTensor, Shard

from torchtitan.components.train_state import NonFiniteError
from torchtitan.distributed import local_tensor, pipeline_split, simple_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.module_names import clean_name

_BACKWARD_NAN = re.compile(r"Function '(\w+)' returned nan values in its (\d+)th output")
_FORWARD_TRACE = "Traceback of forward call that caused the error"
_ENABLED_NOTICE = "Anomaly Detection has been enabled"
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_T = TypeVar("_T", bound=BaseException)


def per_op_checks(dims: ParallelDims, fsdp_impl: str) -> bool:
    """Whether autograd's per-op check can read this layout's gradients: not where the model
    computes with DTensors (tensor, context or expert parallel weights, DTensor-parametrized
    data parallelism) or ranks are simulated; FSDP2 and replicated data parallel compute on
    plain tensors."""
    dtensors = dims.tp_enabled or dims.cp_enabled or dims.ep_enabled
    return not (
        dtensors or (fsdp_impl == "simple" and dims.dp_enabled) or local_tensor.is_simulating()
    )


def checked(per_op: bool) -> str:
    """What the watch checks, in words (for the log and the line of a gradient norm that it
    did not see coming)."""
    return "every module's output and the gradient reaching it for NaN/inf" + (
        ", and every backward op's output for NaN" if per_op else ""
    )


@contextlib.contextmanager
def watch(
    model_parts: Sequence[nn.Module],
    *,
    step: int,
    rank: int,
    per_op: bool,
    last_checkpoint: Callable[[], object],
) -> Iterator[None]:
    """Check every module's output and the gradient reaching it during the block (forward and
    backward of one step), and each backward op with ``per_op``; turn the first non-finite
    value into a ``NonFiniteError`` naming where it began. Leaves no hook, anomaly mode or
    warning setting behind."""
    checks = _Checks()
    handles = [
        # Before FSDP's own hook reshards the weights: the module's whole weights are seen.
        module.register_forward_hook(
            checks.output_check(name, module, part), with_kwargs=True, prepend=True
        )
        for part in model_parts
        for name, module in part.named_modules()
        if not isinstance(module, (ActivationWrapper, *simple_fsdp.PARAMETRIZATIONS))
    ]
    handles += [
        part.register_forward_pre_hook(checks.input_check(part), with_kwargs=True)
        for part in model_parts
    ]
    # A multi-stage schedule that catches a stage's error logs it and its whole timetable.
    pipeline_logger = logging.getLogger(pipeline_split.SCHEDULES_LOGGER)
    pipeline_logger.addFilter(_not_a_finding)
    anomaly_mode = (
        torch.autograd.set_detect_anomaly(True, check_nan=True)
        if per_op
        else contextlib.nullcontext()
    )
    forward_traces: list[str] = []
    try:
        with anomaly_mode, _forward_traces_into(forward_traces):
            yield
    except Exception as e:
        # Raised in a hook or by autograd, maybe wrapped on its way (a pipeline schedule).
        if (found := _in_chain(e, _Found)) is not None:
            what, where = found.what, found.rank if found.rank is not None else rank
        elif (what := _backward_nan(e, forward_traces)) is not None:
            where = rank
        else:
            raise
        if found is None or found.backward:
            # Weights that blew up (a learning rate too high), or an op failing on sane ones.
            what += f"; in this rank's model, {_largest(_parameters(model_parts))}"
        raise NonFiniteError.located(step, where, what, last_checkpoint()) from None
    finally:
        pipeline_logger.removeFilter(_not_a_finding)
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


def _not_a_finding(record: logging.LogRecord) -> bool:
    """A log filter: drops what a pipeline schedule logs while it handles one of our
    findings (raised in a hook, or anomaly mode's NaN); keeps the rest."""
    error = sys.exc_info()[1]
    if error is None:
        return True
    return _in_chain(error, _Found) is None and not any(
        _BACKWARD_NAN.search(str(e)) for e in _chain(error)
    )


class _Checks:
    """The hooks of one step, and what they have seen so far."""

    def __init__(self):
        self.last_finite_gradient: str | None = None
        """The module whose output's gradient was last found finite in this backward."""
        self.last_gradient: torch.Tensor | None = None

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
            after = self.last_finite_gradient
            if (bad := _first_nonfinite(grad)) is None:
                # A tensor that is the output of a module and of its parent keeps the inner name.
                if grad is not self.last_gradient:
                    self.last_finite_gradient, self.last_gradient = label, grad
                return
            raise _Found(
                f"the gradient reaching the output of {label} holds {bad[0]}, made in the "
                "backward of what uses that output"
                + (f" (the last gradient found finite reached {after})" if after else ""),
                bad[1],
                backward=True,
            )

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            if not name:  # a part's forward is done: its backward (micro-batch) starts afresh
                self.last_finite_gradient = self.last_gradient = None
            bad = _first_nonfinite(output)
            if bad is None:
                for leaf in pytree.tree_leaves(output):
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        leaf.register_hook(gradient_check)
                return
            kind, rank = bad
            given = _first_nonfinite((args, kwargs), rank=rank)
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


def _values(t: torch.Tensor) -> list[tuple[int | None, torch.Tensor]]:
    """``(simulated rank or None, this rank's values)`` of ``t``: a DTensor's local shard, each
    simulated rank's value of a ``LocalTensor``. Read them inside ``host_only``."""
    return local_tensor.by_rank((t.to_local() if isinstance(t, DTensor) else t).detach())


def _first_nonfinite(tree: object, *, rank: int | None = None) -> tuple[str, int | None] | None:
    """``("nan" | "inf", simulated rank or None)`` of the first floating (or complex) tensor
    in ``tree`` holding such a value (on simulated rank ``rank`` only, if given); ``None`` when
    all are finite."""
    leaves = [
        leaf
        for leaf in pytree.tree_leaves(tree)
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
    ]
    with local_tensor.host_only():
        for leaf in leaves:
            for r, value in _values(leaf):
                if (rank is None or r in (None, rank)) and not bool(torch.isfinite(value).all()):
                    return ("nan" if bool(torch.isnan(value).any()) else "inf"), r
    return None


def _largest(params: list[tuple[str, torch.Tensor]]) -> str:
    """What parameters hold: the first non-finite one, or the largest magnitude and where
    (of this rank's shard, for a sharded one)."""
    sizes = []
    with local_tensor.host_only():
        for name, param in params:
            sharded = isinstance(param, DTensor) and any(
                isinstance(p, Shard) for p in param.placements
            )
            where = clean_name(name) + (", this rank's shard" if sharded else "")
            for _, value in _values(param):
                if not bool(torch.isfinite(value).all()):
                    return f"{where} holds non-finite values"
                if value.numel():
                    sizes.append((float(value.abs().max()), where))
    if not sizes:
        return "no parameter holds values"
    size, where = max(sizes)
    return f"the largest parameter value is {size:.3g} (in {where})"


def _parameters(model_parts: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    return [named for part in model_parts for named in part.named_parameters()]


@contextlib.contextmanager
def _forward_traces_into(traces: list[str]) -> Iterator[None]:
    """Keep anomaly mode's warnings (the forward traceback of a backward NaN, the notice that
    it is on) out of the console, into ``traces``; every other warning is shown as usual
    (the filters are untouched). Only the main thread swaps ``warnings.showwarning``, a
    process-wide hook: simulated pipeline ranks (threads) go without the traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if _FORWARD_TRACE in text:
            traces.append(text)
        elif not text.startswith(_ENABLED_NOTICE):
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _backward_nan(error: BaseException, forward_traces: list[str]) -> str | None:
    """What anomaly mode's error (anywhere in the chain) says, with the model line of its
    forward; ``None`` for another error."""
    for e in _chain(error):
        if (match := _BACKWARD_NAN.search(str(e))) is not None:
            function, output = match.groups()
            what = f"the backward of {function} returned nan in its output {output}"
            line = _forward_line(forward_traces)
            return what + (f"; its forward: {line}" if line else "")
    return None


def _forward_line(forward_traces: list[str]) -> str | None:
    """The innermost frame of the last forward traceback that is neither torch's nor another
    installed package's (torchao, peft): ``path:line (code)``, the model's line."""
    for text in reversed(forward_traces):
        frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s+(.+)', text)
        ours = [f for f in frames if not f[0].startswith(_TORCH_DIR) and "-packages" not in f[0]]
        if ours:
            path, line, code = ours[-1]
            return f"{os.path.relpath(path)}:{line} ({code.strip()})"
    return None

"""``--debug.host_sync_step N``: where one training step reads device values on the host.

A GPU runs ahead of the Python that feeds it until the host needs a value only the GPU has
(``.item()``, ``bool(t)``, ``.tolist()``, or an op whose output size depends on the data, such
as ``nonzero``). Then the host waits for every queued kernel, and the GPU idles while the host
catches up: a profile shows it as ``cudaStreamSynchronize`` beside an idle gap. This census
lists each such read of the step with the line of ours that asked for it, so a new one on the
hot path is found on any machine, before it costs GPU time.

On a GPU only reads of device tensors count, and copies between the host and the device
that wait (to the host, or to the device without ``non_blocking``). On a CPU every tensor is
on the host, so the census lists every read that would wait on a GPU, including reads of
tensors a GPU run keeps on the host (such as the token counts, counted on the batch before it
moves): its site says which; copies it cannot see there. Ops are seen through a
``TorchDispatchMode`` that compiled code ignores: blocks compiled with ``fullgraph=True``
cannot read values on the host, and run as they do without the census.

Afterwards every rank writes ``<dump>/host_syncs/rank<r>_step<N>.txt`` and the logging rank
prints the table.
"""

import collections
import contextlib
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.tools.logging import logger

# Ops that wait for the device on CUDA: they return a host value, or size their output by the
# data. ``bincount`` reads the input's min and max; ``repeat_interleave`` and ``histc`` only
# when their output size or range is not given.
_ALWAYS = {
    "aten::_local_scalar_dense": "a value read on the host (.item(), int(), float(), bool())",
    "aten::nonzero": "nonzero: output size depends on the data",
    "aten::masked_select": "masked_select: output size depends on the data",
    "aten::bincount": "bincount: reads the input's min and max",
    "aten::_unique2": "unique: output size depends on the data",
    "aten::unique_dim": "unique: output size depends on the data",
    "aten::unique_consecutive": "unique_consecutive: output size depends on the data",
    "aten::equal": "equal: returns a host bool",
    "aten::is_nonzero": "a tensor's truth read on the host",
}

_PACKAGE = str(Path(__file__).resolve().parents[1])  # .../torchtitan
_THIS = str(Path(__file__).resolve())


def _reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why ``func(*args, **kwargs)`` waits for the device on CUDA, or ``None``."""
    name = func._schema.name
    if name in _ALWAYS:
        return _ALWAYS[name]
    if name == "aten::repeat_interleave" and func._overloadname == "Tensor":
        if kwargs.get("output_size") is None:
            return "repeat_interleave without output_size: output size depends on the data"
    if name == "aten::histc":
        low = args[2] if len(args) > 2 else kwargs.get("min", 0)
        high = args[3] if len(args) > 3 else kwargs.get("max", 0)
        if low == high:
            return "histc without a range: reads the input's min and max"
    if name in ("aten::index", "aten::index_put_", "aten::index_put"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if not any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return None
        if name != "aten::index" and _fills_by_mask(args, kwargs):
            return None  # ``t[mask] = scalar``: ATen fills in place (masked_fill_)
        return "indexing by a boolean mask: output size depends on the data"
    if name in ("aten::_to_copy", "aten::copy_"):
        return _copy_reason(name, args, kwargs)
    return None


def _fills_by_mask(args: tuple, kwargs: dict) -> bool:
    """ATen's ``index_put_`` takes ``masked_fill_`` (no sync) for one boolean mask on
    ``self``'s device, every other index empty, and a one-element host value."""
    target, indices = args[0], args[1] if len(args) > 1 else kwargs.get("indices", ())
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    given = [i for i in indices if i is not None]
    return (
        not accumulate
        and value.numel() == 1
        and value.device.type == "cpu"
        and len(given) == 1
        and given[0].dtype in (torch.bool, torch.uint8)
        and given[0].device == target.device
    )


def _copy_reason(name: str, args: tuple, kwargs: dict) -> str | None:
    """A copy between the host and a device waits for the device unless ``non_blocking``
    (a copy to the host always waits: its values are read next)."""
    if name == "aten::_to_copy":
        source, target = args[0].device, kwargs.get("device") or args[0].device
        blocking = not kwargs.get("non_blocking", False)
    else:
        target, source = args[0].device, args[1].device
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    target = torch.device(target)
    if source.type != "cpu" and target.type == "cpu":
        return "a copy to the host"
    if source.type == "cpu" and target.type != "cpu" and blocking:
        return "a blocking copy to the device (non_blocking=False)"
    return None


def _site() -> str:
    """Our innermost line that asked, with its caller in our code when there is one."""
    ours = [
        f
        for f in traceback.extract_stack()
        if f.filename.startswith(_PACKAGE) and f.filename != _THIS
    ]
    if not ours:
        return "(outside torchtitan)"
    names = [f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in ours[-2:]]
    return " <- ".join(reversed(names))


def _short(filename: str) -> str:
    return "torchtitan" + filename[len(_PACKAGE) :].replace("\\", "/")


class HostSyncCensus(TorchDispatchMode):
    """Counts the reads of device values on the host made inside it, by site and reason.

    ``device_only``: count only ops on non-CPU tensors (the GPU case); on a CPU run every op
    counts. A census counts its own thread's reads (pipeline ranks simulated as threads each
    keep their own).
    """

    def __init__(self, *, device_only: bool) -> None:
        super().__init__()
        self.device_only = device_only
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._quiet = False  # inside a patched method: its own ops are not counted again

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Compiled code runs as compiled (fullgraph blocks cannot read on the host); without
        # this, torch.compile skips every frame under the mode and fullgraph=True fails.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._quiet and (reason := _reason(func, args, kwargs)) is not None:
            if self._counts_on(args, kwargs):
                self.counts[(_site(), reason)] += 1
        return func(*args, **kwargs)

    def _counts_on(self, args: tuple, kwargs: dict) -> bool:
        if not self.device_only:
            return True
        target = kwargs.get("device")  # a copy to a device
        if target is not None and torch.device(target).type != "cpu":
            return True
        return any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)

    def __enter__(self):
        _methods.enter(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _methods.exit()

    def count_method(self, tensor: torch.Tensor, reason: str) -> None:
        if not self.device_only or tensor.device.type != "cpu":
            self.counts[(_site(), reason)] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def table(self) -> str:
        """One line per site and reason, the most frequent first."""
        lines = [
            f"{n:4d}x  {site}\n       {reason}"
            for (site, reason), n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))
        ]
        return "\n".join(lines) if lines else "   none"


class _TensorMethods:
    """``tolist``, ``numpy`` and ``cpu`` read a host tensor without an op a mode sees: they
    are wrapped while any census is open (in any thread), and each call counts in its own
    thread's census. The one patch of ``torch.Tensor`` in the package; restored when the
    last census closes."""

    NAMES = {
        "tolist": "tolist: values read on the host",
        "numpy": "numpy: values read on the host",
        "cpu": "cpu: a copy to the host",
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._originals: dict[str, Callable] = {}
        self._local = threading.local()

    def enter(self, census: HostSyncCensus) -> None:
        stack = getattr(self._local, "stack", None)
        self._local.stack = [*(stack or []), census]
        with self._lock:
            self._open += 1
            if self._open == 1:
                for name, reason in self.NAMES.items():
                    self._originals[name] = original = getattr(torch.Tensor, name)
                    setattr(torch.Tensor, name, self._wrapped(original, reason))

    def exit(self) -> None:
        self._local.stack = self._local.stack[:-1]
        with self._lock:
            self._open -= 1
            if self._open == 0:
                for name, original in self._originals.items():
                    setattr(torch.Tensor, name, original)
                self._originals.clear()

    def _wrapped(self, original: Callable, reason: str) -> Callable:
        def read_on_host(tensor, *args, **kwargs):
            stack = getattr(self._local, "stack", None)
            census = stack[-1] if stack else None
            if census is None or census._quiet:
                return original(tensor, *args, **kwargs)
            census.count_method(tensor, reason)
            census._quiet = True  # a device tensor's copy to the host is this same read
            try:
                return original(tensor, *args, **kwargs)
            finally:
                census._quiet = False

        return read_on_host


_methods = _TensorMethods()


@contextlib.contextmanager
def maybe_count_host_syncs(
    step: int,
    host_sync_step: int,
    *,
    device: torch.device,
    dump_folder: str,
    rank: int,
    reports: bool,
) -> Iterator[None]:
    """Count the host syncs inside when ``step == host_sync_step``; else nothing.
    ``reports``: the step logs, and reads the model's metrics for it (MoE loads)."""
    if step != host_sync_step:
        yield
        return
    on_gpu = device.type != "cpu"
    census = HostSyncCensus(device_only=on_gpu)
    with census:
        yield
    scope = (
        "reads of device tensors"
        if on_gpu
        else "on a CPU every tensor is on the host: the reads that would wait for a GPU"
    )
    kind = (
        "a logging step: with the metrics it reports, not the logged loss and norm"
        if reports
        else "not a logging step"
    )
    text = (
        f"Host syncs of step {step}'s training step ({kind}), rank {rank}: "
        f"{census.total} at {len(census.counts)} site(s); {scope}\n{census.table()}\n"
    )
    folder = Path(dump_folder) / "host_syncs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}_step{step}.txt"
    path.write_text(text)
    logger.info(f"{text.rstrip()}\n(written to {path})")

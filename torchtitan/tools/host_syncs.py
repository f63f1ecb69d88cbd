"""``--debug.host_sync_step N``: where one training step reads device values on the host.

A GPU runs ahead of the Python that feeds it until the host needs a value only the GPU has
(``.item()``, ``bool(t)``, ``.tolist()``, or an op whose output size depends on the data, such
as ``nonzero``). Then the host waits for every queued kernel, and the GPU idles while the host
catches up: a profile shows it as ``cudaStreamSynchronize`` beside an idle gap. This census
lists each such read of the step with the line of ours that asked for it, so a new one on the
hot path is found on any machine, before it costs GPU time.

On a GPU only reads of device tensors count. On a CPU every tensor is on the host, so the
census lists every read that would wait on a GPU, including reads of tensors a GPU run keeps
on the host (such as the token counts, counted on the batch before it moves): its site says
which. Ops are seen through a ``TorchDispatchMode``, so code compiled with ``fullgraph=True``
(which cannot read values on the host) runs as it does without the census.

Afterwards every rank writes ``<dump>/host_syncs/rank<r>_step<N>.txt`` and the logging rank
prints the table.
"""

import collections
import contextlib
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
        if name != "aten::index":
            value = args[2] if len(args) > 2 else kwargs.get("values")
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            if not accumulate and value.numel() == 1 and value.device.type == "cpu":
                return None  # ``t[mask] = scalar``: ATen fills in place (masked_fill_)
        return "indexing by a boolean mask: output size depends on the data"
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
    counts.
    """

    def __init__(self, *, device_only: bool) -> None:
        super().__init__()
        self.device_only = device_only
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._patched: list[tuple[str, Callable]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Compiled code runs as compiled (fullgraph blocks cannot read on the host); without
        # this, torch.compile skips every frame under the mode and fullgraph=True fails.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _reason(func, args, kwargs)
        if reason is not None and self._counts_on(args):
            self.counts[(_site(), reason)] += 1
        return func(*args, **kwargs)

    def _counts_on(self, args: tuple) -> bool:
        if not self.device_only:
            return True
        return any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)

    def __enter__(self):
        # ``tolist``, ``numpy`` and ``cpu`` copy without an op the mode sees on a host tensor.
        for name, reason in (
            ("tolist", "tolist: values read on the host"),
            ("numpy", "numpy: values read on the host"),
            ("cpu", "cpu: a copy to the host"),
        ):
            original = getattr(torch.Tensor, name)
            self._patched.append((name, original))
            setattr(torch.Tensor, name, self._wrap(original, reason))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched:
            setattr(torch.Tensor, name, original)
        self._patched.clear()
        return super().__exit__(*exc)

    def _wrap(self, original: Callable, reason: str) -> Callable:
        census = self

        def read_on_host(tensor, *args, **kwargs):
            if not census.device_only or tensor.device.type != "cpu":
                census.counts[(_site(), reason)] += 1
            return original(tensor, *args, **kwargs)

        return read_on_host

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


@contextlib.contextmanager
def maybe_count_host_syncs(
    step: int, host_sync_step: int, *, device: torch.device, dump_folder: str, rank: int
) -> Iterator[None]:
    """Count the host syncs inside when ``step == host_sync_step``; else nothing."""
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
    text = (
        f"Host syncs of step {step} (the training step, logging aside), rank {rank}: "
        f"{census.total} at {len(census.counts)} site(s); {scope}\n{census.table()}\n"
    )
    folder = Path(dump_folder) / "host_syncs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}_step{step}.txt"
    path.write_text(text)
    logger.info(f"{text.rstrip()}\n(written to {path})")

"""Per-rank memory estimate of a training step, from fake tensors (no memory, no compute).

Running a full-depth 70B or 405B step on fake tensors still costs minutes of dispatch on a
CPU. Transformer blocks are identical, so the step runs on copies of the model with 1 and 2
blocks (same dims, same parallelization), and the peak is extrapolated to the real depth
from what one more block adds (:func:`extrapolate_peak`). Parameter, gradient and
optimizer-state bytes are also counted exactly on the full-depth (meta) model.
"""

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from torchtitan.config import JobConfig
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger

GiB = 2**30


def format_bytes(n: int) -> str:
    """Bytes as GiB, or MiB below 1 GiB (debug models)."""
    return f"{n / GiB:9.2f} GiB" if n >= GiB else f"{n / 2**20:9.1f} MiB"


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its local shard); works on meta."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):  # optimizer states also hold plain numbers
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def held_mib(parameters: Iterable[torch.Tensor], optimizer_state: Iterable) -> dict[str, float]:
    """This rank's share of parameters and optimizer state (what sharding shrinks), logged."""
    params = local_bytes(parameters)
    optim = local_bytes(optimizer_state)
    mib = {"param_mib": params / 2**20, "optimizer_state_mib": optim / 2**20}
    logger.info(
        f"This rank holds {mib['param_mib']:.1f} MiB of parameters and "
        f"{mib['optimizer_state_mib']:.1f} MiB of optimizer state"
    )
    return mib


def peak_by_category(
    model_parts: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    forward_backward: Callable[[], None],
    optimizer_step: Callable[[], None],
) -> dict[str, dict[str, int]]:
    """Bytes per category (parameters, gradients, optimizer state, activations, ...) at two
    moments of forward + backward, in steady state: ``"peak"``, the step's peak, and
    ``"forward"``, the end of the last part's forward (every block's activations alive).

    A shallow copy of a model may peak elsewhere than the full depth does: with the sequence
    split (context parallelism) the output layer's gradients can outweigh two blocks'
    activations, so its peak moves after the blocks' backward; the end of the forward is the
    moment that grows with depth. Extrapolate both and keep the larger.

    A first, untracked step creates the optimizer state; torch's ``MemTracker`` then follows
    the second forward and backward with parameters and optimizer state registered. The
    optimizer step itself is not tracked: under fake tensors, torch 2.13's tracker files the
    DTensor optimizer state it creates at its global size (terabytes for 405B); its own
    temporaries are small next to the activations.
    """
    forward_backward()
    optimizer_step()
    tracker = _frozen_aware_tracker()
    tracker.track_external(*model_parts, *optimizers)
    moments = {}

    def end_of_forward(*_) -> None:
        (moments["forward"],) = tracker.get_tracker_snapshot().values()

    hook = model_parts[-1].register_forward_hook(end_of_forward)
    try:
        with tracker:
            forward_backward()
    finally:
        hook.remove()
    optimizer_step()
    (moments["peak"],) = tracker.get_tracker_snapshot("peak").values()
    return {
        moment: {str(getattr(k, "value", k)): int(v) for k, v in snapshot.items()}
        for moment, snapshot in moments.items()
    }


class _NoHook:
    """A stand-in for a removable hook handle."""

    def remove(self) -> None:
        pass


def _frozen_aware_tracker():
    """torch's tracker hooks the gradient of every parameter a module holds when it runs, and
    a frozen one (LoRA's base weights; under FSDP the unsharded copy of one) refuses hooks
    (torch 2.11-2.13): this one marks those hooked already, as they never get a gradient to
    follow."""
    # Imported here: torch's tracker loads dynamo, half a second of every rank's start.
    from torch.distributed._tools.mem_tracker import MemTracker

    class FrozenAwareTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for param in module.parameters():
                if not param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenAwareTracker()


def fake_tensor_mode() -> contextlib.AbstractContextManager:
    """Tensors created inside have shapes and dtypes but no storage; ops only infer shapes."""
    return FakeTensorMode(allow_non_fake_inputs=True)


@dataclasses.dataclass
class MemoryEstimate:
    """One rank's memory: exact state bytes and the extrapolated peak of a step."""

    n_layers: int
    parameters: int
    """Bytes of this rank's parameter shards (exact)."""
    gradients: int
    """Bytes of this rank's gradient shards (exact: one per parameter, same dtype)."""
    optimizer: int
    """Bytes of optimizer state: parameters times the state-per-parameter ratio measured on
    the shallow copies after their steps."""
    peak: dict[str, int]
    """Bytes per category at the step's peak, extrapolated to ``n_layers`` blocks."""

    @property
    def peak_total(self) -> int:
        return self.peak["Total"]

    def report(self, device_memory_gib: float, *, advice: str) -> str:
        """Lines for the console: state, peak by category, and whether it fits (else
        ``advice``)."""
        lines = [
            f"  parameters        {format_bytes(self.parameters)}  (exact)",
            f"  gradients         {format_bytes(self.gradients)}  (exact)",
            f"  optimizer state   {format_bytes(self.optimizer)}",
            f"  peak of a step    {format_bytes(self.peak_total)}, of which:",
        ]
        for name, value in sorted(self.peak.items(), key=lambda kv: -kv[1]):
            if name != "Total" and value >= 2**20:
                lines.append(f"    {name:<16}{format_bytes(value)}")
        budget = device_memory_gib * GiB
        if self.peak_total <= budget:
            lines.append(
                f"  fits a {device_memory_gib:g} GiB device with "
                f"{(budget - self.peak_total) / GiB:.2f} GiB to spare"
            )
        else:
            lines.append(
                f"  does NOT fit a {device_memory_gib:g} GiB device (over by "
                f"{(self.peak_total - budget) / GiB:.2f} GiB): {advice}"
            )
        return "\n".join(lines)


def extrapolate(one: dict[str, int], two: dict[str, int], n_layers: int) -> dict[str, int]:
    """Linear in the number of blocks: ``one + (n_layers - 1) * (two - one)`` per category."""
    return {k: max(0, one[k] + (n_layers - 1) * (two.get(k, 0) - one[k])) for k in one}


_HELD_PER_BLOCK = ("Parameter", "Buffer", "Activation", "Optstate")
"""What each block adds that stays alive to the end of forward (its parameter and optimizer
state shards, what its forward saved for backward)."""


def extrapolate_peak(
    one: dict[str, dict[str, int]], two: dict[str, dict[str, int]], n_layers: int
) -> dict[str, int]:
    """The step's peak at ``n_layers`` blocks from the 1- and 2-block probes' ``"peak"`` and
    ``"forward"`` moments (:func:`peak_by_category`); the categories sum to ``"Total"``.

    The 2-block peak, plus per further block what a block holds at the end of forward and its
    gradient; temporaries do not grow with depth. A line through both probes' peaks per
    category would not do: the probes may peak at different moments of the step (DeepSeek-V3
    671B at EP 8: the loss's temporaries with one block, an MoE block's backward with two), and
    the FSDP gradient buffers pending at a 2-block peak read as "Temp" growing by a block's
    worth. Against full-depth steps on fake tensors (``tests``, and 671B at 256 ranks, 6 minutes
    each): Llama 3 debug layouts and the DeepSeek-V3 debug model 0 to +5%; 671B EP 8 -1%,
    EP 16 +10% (a line through the peaks: +48% and +100%); -3.5% and +6.7% once its dense
    blocks' state is counted as such (:func:`with_exact_state`). An upper bound where the full
    depth peaks at the end of backward (it counts every block's saved activations and
    gradients at once).
    """
    peak_one, peak_two = one["peak"], two["peak"]
    per_block = {k: two["forward"].get(k, 0) - one["forward"].get(k, 0) for k in _HELD_PER_BLOCK}
    per_block["Gradient"] = peak_two.get("Gradient", 0) - peak_one.get("Gradient", 0)
    peak = {
        k: max(0, v + (n_layers - 2) * per_block.get(k, 0))
        for k, v in peak_two.items()
        if k != "Total"
    }
    return peak | {"Total": sum(peak.values())}


def with_exact_state(
    moment: dict[str, int],
    one: dict[str, int],
    two: dict[str, int],
    exact: dict[str, int],
    n_layers: int,
) -> dict[str, int]:
    """``moment``, extrapolated from the 1- and 2-block probes, with its ``Parameter`` and
    ``Optstate`` moved by what the extrapolation gets wrong about the state the model holds
    all step long: ``one`` and ``two`` are the probes' state bytes, ``exact`` the full model's.

    Zero for a model of identical blocks. Where blocks differ, the probes are copies of the
    larger kind and count the others as that: DeepSeek-V3 671B's three dense blocks as MoE
    blocks, 0.96 GiB of optimizer state too many at EP 8 on 256 ranks. A category's gathered
    or pending bytes (FSDP's unsharded block) stay."""
    extrapolated = extrapolate(one, two, n_layers)
    moved = {
        k: max(0, moment.get(k, 0) - (extrapolated[k] - exact[k]))
        for k in ("Parameter", "Optstate")
        if k in moment
    }
    out = {k: v for k, v in moment.items() if k != "Total"} | moved
    return out | {"Total": sum(out.values())}


def host_memory_bytes() -> int | None:
    """This machine's memory and swap (``MemTotal + SwapTotal``: the kernel kills a process
    only when both are full); ``None`` where ``/proc/meminfo`` is not there."""
    sizes = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("MemTotal", "SwapTotal"):
                    sizes[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return sum(sizes.values()) if "MemTotal" in sizes else None


@dataclasses.dataclass(frozen=True)
class HostNeed:
    """A lower bound of what the ranks of one machine hold at once in a CPU run.

    ``per_rank``: what the rank holding least holds (``host_need``: its parameters, and for
    the trainable ones a gradient and the optimizer's states (AdamW 2, Muon at least 1) when
    the run trains; at start-up also the whole model once, the one-process initialisation
    that multi-rank CPU runs cut their shards from), times the ``ranks`` of the machine."""

    per_rank: int
    ranks: int
    builds_whole: bool

    @property
    def total(self) -> int:
        return self.per_rank * self.ranks


def host_need(
    model_parts: Sequence[nn.Module],
    *,
    optimizer_states: int,
    trains: bool,
    builds_whole: bool,
    ranks: int,
) -> HostNeed:
    """:class:`HostNeed` of this rank's parallelized model parts (on meta, before they are
    materialised). The whole model is counted from the parts' parameters at their full size (a
    DTensor's global shape): all of it without pipeline parallelism, this rank's stages with
    it (less than the whole: still a lower bound)."""
    params = [p for part in model_parts for p in part.parameters()]
    local = local_bytes(params)
    trainable = local_bytes(p for p in params if p.requires_grad) if trains else 0
    steady = local + trainable * (1 + optimizer_states)
    whole = 4 * sum(p.numel() for p in params)  # the one-process init is built in float32
    start = whole + local if builds_whole else 0
    return HostNeed(max(steady, start), ranks, builds_whole)


def host_shortfall(need: HostNeed, available: int | None) -> str | None:
    """Why ``need`` cannot fit a machine of ``available`` bytes, or ``None`` when it may."""
    if available is None or need.total <= available:
        return None
    size = lambda n: format_bytes(n).strip()  # noqa: E731
    ranks = f"{need.ranks} ranks x {size(need.per_rank)}" if need.ranks > 1 else "1 rank"
    return (
        f"needs at least {size(need.total)} of memory and swap on this machine ({ranks}: "
        f"weights, gradients and optimizer state"
        f"{', and the whole model once at start-up' if need.builds_whole else ''}), more than "
        f"its {size(available)}"
    )


def check_host_memory(
    model_parts: Sequence[nn.Module], config: JobConfig, *, builds_whole: bool
) -> None:
    """Refuse a CPU run whose weights, gradients and optimizer state cannot fit this machine,
    before they are made (parts parallelized on meta): the kernel would kill a rank without
    a word of why. ``builds_whole``: the ranks build the one-process initialisation. Ranks
    hold different shares (pipeline stages, uneven shards): the bound takes the least any
    rank holds, times the ranks of a machine, so that every rank gives the same answer."""
    if config.comm.mode != "default":  # simulations hold no real state
        return
    need = host_need(
        model_parts,
        optimizer_states=1 if config.optimizer.name == "Muon" else 2,
        trains=not config.checkpoint.create_seed_checkpoint,
        builds_whole=builds_whole,
        ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    if dist.is_initialized():
        least = torch.tensor([need.per_rank], dtype=torch.int64)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        need = dataclasses.replace(need, per_rank=int(least.item()))
    if (why := host_shortfall(need, host_memory_bytes())) is not None:
        raise ConfigError(
            f"--model.flavor {config.model.flavor} of {config.model.name} {why}: train a "
            f"smaller flavor, or spread the ranks over more machines; COMM_MODE=fake_backend "
            f"estimates any layout's memory without the weights (docs/debugging.md)"
        )

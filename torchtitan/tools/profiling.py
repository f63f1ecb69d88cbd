"""Step profiling (Chrome traces) and memory snapshots, both driven by ``profiling.*``.

Every ``profile_freq`` steps the profiler records ``profiler_active`` steps after
``profiler_warmup`` warm-up steps and writes one trace per rank:
``<dump>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json`` (open it in Perfetto or
chrome://tracing).

Memory snapshots on CUDA record the caching allocator's history and write
``<dump>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle``
every ``profile_freq`` steps (drag it into https://pytorch.org/memory_viz); on an out-of-memory
error one more goes to ``iteration_<step>_exit/`` before the error propagates. The CPU build
has no allocator history, so there the profiler's memory timeline is written instead
(``rank<r>_memory_timeline.json``: time stamps and bytes per category).
"""

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from torchtitan.config.job_config import Profiling
from torchtitan.tools.logging import logger

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events kept for a snapshot: enough for a few steps of a large model."""


def _activities() -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def _schedule(config: Profiling, **extra) -> torch.profiler.profiler.ProfilerAction:
    wait = config.profile_freq - config.profiler_warmup - config.profiler_active
    return torch.profiler.schedule(
        wait=wait, warmup=config.profiler_warmup, active=config.profiler_active, **extra
    )


@contextlib.contextmanager
def maybe_enable_profiling(
    config: Profiling, *, dump_folder: str, rank: int, first_step: int
) -> Iterator[torch.profiler.profile | None]:
    """A profiler to ``.step()`` once per training step, or ``None`` when disabled.

    ``first_step`` is the step the loop starts at (after a resume), so trace folders are
    named by the real step.
    """
    if not config.enable_profiling:
        yield None
        return
    folder = Path(dump_folder) / config.save_traces_folder

    closing = False  # the loop is over: the profiler is being stopped

    def write_trace(prof: torch.profiler.profile) -> None:
        step = first_step + prof.step_num
        if closing:
            # Whole cycles are handed over by ``prof.step()``; on exit torch hands over the
            # cycle the run ended in, which holds no whole recorded step (or an unfinished
            # cycle), and would overwrite the last whole one's trace when it has its number.
            logger.info(
                f"Profiler: the run ended inside a profiling cycle (step {step}): not saved"
            )
            return
        out = folder / f"iteration_{step}"
        out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        prof.export_chrome_trace(str(out / f"rank{rank}_trace.json"))
        logger.info(
            f"Profiler trace of step {step} written to {out} in {time.perf_counter() - start:.2f} s"
        )

    logger.info(
        f"Profiling {config.profiler_active} step(s) every {config.profile_freq} into {folder} "
        f"({', '.join(a.name for a in _activities())})"
    )
    with torch.profiler.profile(
        activities=_activities(),
        schedule=_schedule(config, skip_first=0),
        on_trace_ready=write_trace,
        record_shapes=True,
    ) as prof:
        prof.step_num = 0
        try:
            yield prof
        finally:
            closing = True


class MemorySnapshots:
    """Writes a memory snapshot every ``profile_freq`` steps and one on an OOM."""

    def __init__(self, config: Profiling, *, dump_folder: str, rank: int, first_step: int):
        self.folder = Path(dump_folder) / config.save_memory_snapshot_folder
        self.freq = config.profile_freq
        self.rank = rank
        self.step_num = first_step
        self.cuda = torch.cuda.is_available()
        self._profiler: torch.profiler.profile | None = None
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            logger.info(f"Recording CUDA allocator history for snapshots into {self.folder}")
        elif config.enable_profiling:
            # Only one profiler session can run at a time.
            logger.warning(
                "Memory snapshots need the CUDA caching allocator; the CPU memory timeline "
                "that replaces them needs the profiler, which --profiling.enable_profiling "
                "already uses: no memory timeline this run"
            )
            self.freq = 0
        else:
            logger.warning(
                "Memory snapshots need the CUDA caching allocator, which this process does "
                "not use: writing the profiler's CPU memory timeline instead "
                f"(rank{rank}_memory_timeline.json under {self.folder})"
            )
            self._start_profiler()

    def _start_profiler(self) -> None:
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=True,
            with_stack=True,
        )
        self._profiler.__enter__()

    def step(self, *, exit: bool = False) -> None:
        """Call after each step (``exit=True`` from an OOM handler); dumps when it is time."""
        self.step_num += 1
        if self.freq == 0 or (not exit and self.step_num % self.freq != 0):
            return
        name = f"iteration_{self.step_num}" + ("_exit" if exit else "")
        out = self.folder / name
        out.mkdir(parents=True, exist_ok=True)
        if self.cuda:
            path = out / f"rank{self.rank}_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
        else:
            path = out / f"rank{self.rank}_memory_timeline.json"
            self._profiler.__exit__(None, None, None)
            try:
                with warnings.catch_warnings():
                    # Deprecated in favour of the CUDA allocator's snapshots, which is what a
                    # CPU process lacks: the timeline is the only memory record it has.
                    warnings.filterwarnings("ignore", "`export_memory_timeline`", FutureWarning)
                    self._profiler.export_memory_timeline(str(path), device="cpu")
            except Exception as e:
                # torch's memory categorizer asserts on some graphs (FSDP on CPU, torch
                # 2.13: "version mismatch"); the raw allocation events still tell the peak.
                path = out / f"rank{self.rank}_memory_trace.json"
                peak, op = write_allocation_trace(self._profiler, path)
                logger.warning(
                    f"torch could not categorize this step's memory ({type(e).__name__}): "
                    f"wrote its allocation events instead ({path}; '[memory]' events, "
                    f"'Total Allocated' is the running total); peak {peak / 2**20:.1f} MiB, "
                    f"reached in {op or 'no operator'}"
                )
            if not exit:
                self._start_profiler()
            else:
                self._profiler = None
        logger.info(f"Memory snapshot of step {self.step_num} written to {path}")

    def close(self) -> None:
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
        elif self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None


def write_allocation_trace(profiler: torch.profiler.profile, path: Path) -> tuple[int, str]:
    """Write the allocations and frees a stopped ``profile_memory`` profiler recorded as a
    Chrome/Perfetto trace: an instant ``[memory]`` event each (``Bytes``, negative for a
    free; ``Total Allocated`` after it; the operator it happened in) and a ``Total Allocated``
    counter track. Returns the peak of that total and the operator that reached it.

    Not the profiler's own export: with ``with_stack`` it also holds every Python call (350
    MB for two steps of the debug model under FSDP 2), and torch 2.13's exporter can write a
    function name with unescaped quotes into it, which no JSON reader loads."""
    from torch._C._profiler import _EventType

    allocations, todo = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo += event.children
        if event.typed[0] == _EventType.Allocation:
            allocations.append(event)
    allocations.sort(key=lambda event: event.start_time_ns)
    pid, trace, peak, peak_op = os.getpid(), [], 0, ""
    for event in allocations:
        fields = event.typed[1]
        ts = event.start_time_ns / 1000
        op = event.parent.name if event.parent is not None else ""
        total = fields.total_allocated
        args = {
            "Device": str(fields.device),
            "Addr": fields.ptr,
            "Bytes": fields.alloc_size,
            "Total Allocated": total,
            "Op": op,
        }
        at = {"pid": pid, "ts": ts}
        instant = {"ph": "i", "s": "t", "name": "[memory]", "tid": event.start_tid, "args": args}
        counter = {"ph": "C", "name": "Total Allocated", "args": {"bytes": total}}
        trace += [instant | at, counter | at]
        if total > peak:
            peak, peak_op = total, op
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return peak, peak_op


@contextlib.contextmanager
def maybe_enable_memory_snapshot(
    config: Profiling, *, dump_folder: str, rank: int, first_step: int
) -> Iterator[MemorySnapshots | None]:
    """Memory snapshots for the loop, or ``None``; an OOM inside dumps once and re-raises."""
    if not config.enable_memory_snapshot:
        yield None
        return
    snapshots = MemorySnapshots(config, dump_folder=dump_folder, rank=rank, first_step=first_step)
    try:
        yield snapshots
    except torch.OutOfMemoryError:
        snapshots.step(exit=True)
        raise
    finally:
        snapshots.close()

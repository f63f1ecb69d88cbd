"""Profiler traces: one per recorded cycle, named by the step, none of a cycle cut short."""

import json

import pytest
import torch

from torchtitan.config.job_config import Profiling
from torchtitan.tools.profiling import maybe_enable_profiling, write_allocation_trace


@pytest.mark.parametrize(
    ("freq", "warmup", "active", "steps", "traced"),
    [
        # The run ends in the next cycle's warm-up (step 5): torch handed that over as a trace.
        (3, 1, 1, 5, {13: 1}),
        # Every step recorded: the run ends recording; torch's exit trace (the next step's
        # mark alone) overwrote step 14's, whose 2 steps were lost.
        (2, 0, 2, 4, {12: 2, 14: 2}),
    ],
)
def test_traces_are_written_for_whole_cycles_only(tmp_path, freq, warmup, active, steps, traced):
    config = Profiling(
        enable_profiling=True, profile_freq=freq, profiler_warmup=warmup, profiler_active=active
    )
    with maybe_enable_profiling(config, dump_folder=str(tmp_path), rank=0, first_step=10) as prof:
        for _ in range(steps):
            torch.ones(8).sum()
            prof.step()
    folder = tmp_path / "profile_traces"
    assert sorted(p.name for p in folder.iterdir()) == [f"iteration_{s}" for s in traced]
    for step, recorded in traced.items():
        events = json.loads((folder / f"iteration_{step}" / "rank0_trace.json").read_text())
        marks = [e for e in events["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
        assert len(marks) == recorded
        assert any(e.get("name") == "aten::ones" for e in events["traceEvents"])


def test_the_allocation_trace_holds_each_allocation_and_its_running_total(tmp_path):
    """The fallback of CPU memory snapshots: valid JSON, small, each allocation and free with
    the operator it happened in, and the peak of the running total."""
    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        keep = torch.empty(2**18)  # 1 MiB, kept
        for _ in range(3):
            del keep
            keep = torch.ones(2**18) * 2  # ones, then mul's output: 2 MiB at once
    assert keep[0] == 2
    path = tmp_path / "trace.json"
    peak, op = write_allocation_trace(prof, path)
    events = json.loads(path.read_text())["traceEvents"]
    memory = [e for e in events if e["name"] == "[memory]"]
    counter = [e["args"]["bytes"] for e in events if e["ph"] == "C"]
    assert [e["args"]["Total Allocated"] for e in memory] == counter
    assert [e["ts"] for e in memory] == sorted(e["ts"] for e in memory)
    # The innermost operator: ones allocates in its aten::empty.
    ops = {e["args"]["Op"] for e in memory if e["args"]["Bytes"] == 2**20}
    assert ops == {"aten::empty", "aten::mul"}
    # Each loop frees the tensor before and ones' output; outside an operator a free is
    # placed in the Python function that made it (with_stack).
    frees = [e["args"]["Op"] for e in memory if e["args"]["Bytes"] == -(2**20)]
    assert len(frees) == 6 and all("test_the_allocation_trace_holds" in op for op in frees)
    assert peak == max(counter) and peak - min(counter) >= 2 * 2**20
    assert op == "aten::mul"  # the first time ones' and mul's outputs were both held

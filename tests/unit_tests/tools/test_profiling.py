"""Profiler traces: one per recorded cycle, named by the step, none of a cycle cut short."""

import json

import pytest
import torch

from torchtitan.config.job_config import Profiling
from torchtitan.tools.profiling import maybe_enable_profiling


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

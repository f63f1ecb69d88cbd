"""Profiler traces: one per recorded cycle, named by the step, none of a cycle cut short."""

import torch

from torchtitan.config.job_config import Profiling
from torchtitan.tools.profiling import maybe_enable_profiling


def test_traces_are_written_for_whole_cycles_only(tmp_path):
    """5 steps, a cycle of 3 (1 recorded): step 3's trace. The run ends in the next cycle's
    warm-up (step 5), which torch would also hand over as a trace (it was written, empty)."""
    config = Profiling(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1)
    with maybe_enable_profiling(config, dump_folder=str(tmp_path), rank=0, first_step=10) as prof:
        for _ in range(5):
            torch.ones(8).sum()
            prof.step()
    traces = sorted(p.name for p in (tmp_path / "profile_traces").iterdir())
    assert traces == ["iteration_13"]
    assert (tmp_path / "profile_traces" / "iteration_13" / "rank0_trace.json").stat().st_size

"""The GPU summary of a traced step, on a written trace shaped like torch.profiler's."""

import json
import subprocess
import sys

import pytest

from torchtitan.tools.gpu_trace import report, summarize


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1, **extra) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, **extra}


TRACE = {
    "traceEvents": [
        _x("ProfilerStep#9", "user_annotation", 0, 1000),  # a step before: ignored
        _x("gemm_early", "kernel", 500, 100, tid=7),
        _x("ProfilerStep#10", "user_annotation", 1000, 1000),
        _x("ProfilerStep#10", "gpu_user_annotation", 1010, 1200, tid=7),  # the GPU's copy
        # Two streams overlap (the union counts 1100-1400 once), then a gap, then a copy.
        _x("gemm", "kernel", 1100, 200, tid=7),
        _x("gemm", "kernel", 1300, 100, tid=7),
        _x("nccl_allreduce", "kernel", 1150, 150, tid=8),
        _x("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 1700, 50, tid=7),
        # Launched in the step, ending after the host's mark: the step extends to 2100.
        _x("flash_attn", "kernel", 1900, 200, tid=7),
        # The host: .item() inside aten::_local_scalar_dense waits for the GPU.
        _x("aten::item", "cpu_op", 1500, 300),
        _x("aten::_local_scalar_dense", "cpu_op", 1510, 280),
        _x("cudaMemcpyAsync", "cuda_runtime", 1520, 5),
        _x("cudaStreamSynchronize", "cuda_runtime", 1530, 240),
        _x("cudaLaunchKernel", "cuda_runtime", 1100, 3),
        _x("cudaDeviceSynchronize", "cuda_runtime", 1950, 20),  # outside any operator
    ]
}


def test_the_summary_counts_the_steps_gpu_time_its_host_waits_and_kernels():
    s = summarize(TRACE)
    assert s.wall_ms == pytest.approx(1.1)  # 1000 -> 2100 (the last kernel's end)
    assert s.gpu_busy_ms == pytest.approx(0.3 + 0.05 + 0.2)  # 1100-1400, the copy, 1900-2100
    assert s.gpu_idle_pct == pytest.approx(100 * (1.1 - 0.55) / 1.1)
    assert s.kernels_ms == pytest.approx({"gemm": 0.3, "nccl_allreduce": 0.15, "flash_attn": 0.2})
    assert s.kernel_counts["gemm"] == 2 and "gemm_early" not in s.kernels_ms
    assert s.copies_to_host == 1
    assert s.host_waits == {
        ("cudaStreamSynchronize", "aten::_local_scalar_dense"): [1, pytest.approx(0.24)],
        ("cudaDeviceSynchronize", "(no operator)"): [1, pytest.approx(0.02)],
    }
    text = report(s)
    assert (
        "idle 50.0%" in text and "cudaStreamSynchronize, from aten::_local_scalar_dense: 1" in text
    )
    assert summarize(TRACE, step=9).kernels_ms == {"gemm_early": pytest.approx(0.1)}


def test_the_command_reads_a_trace_file_and_refuses_one_without_steps(tmp_path):
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps(TRACE))
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan.tools.gpu_trace", str(path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.startswith("step 1.1 ms; GPU busy 0.6 ms")
    cpu_only = {"traceEvents": [e for e in TRACE["traceEvents"] if e["cat"] == "user_annotation"]}
    assert report(summarize(cpu_only)) == "step 1.0 ms; no GPU activity in this trace (a CPU run)"
    with pytest.raises(ValueError, match="no ProfilerStep#11 in the trace .it holds 9, 10"):
        summarize(TRACE, step=11)
    with pytest.raises(ValueError, match="no ProfilerStep#"):
        summarize({"traceEvents": [_x("gemm", "kernel", 0, 1)]})

"""What one traced training step did on the GPU, from its Chrome trace (torch.profiler).

    python -m torchtitan.tools.gpu_trace outputs/profile_traces/iteration_10/rank0_trace.json

Prints the step's wall time; the GPU's busy time (the union of its kernels and copies) and
idle share (the host did not keep it fed: Python, data, or a wait for the GPU); the host's
waits for the GPU (stream and device synchronizations, blocking copies to the host such as
``.item()``), each with its count and time and the operator that asked for it; and the
kernels that took the most time. ``benchmarks/bench_gpu.py --profile DIR`` traces a step of
each row and prints this. Reads JSON only: runs anywhere, the trace may come from elsewhere.
"""

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Runtime calls that block the host until the GPU has caught up.
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class StepSummary:
    wall_ms: float
    gpu_busy_ms: float
    kernels_ms: dict[str, float] = field(default_factory=dict)
    kernel_counts: dict[str, int] = field(default_factory=dict)
    # (runtime call, operator that made it) -> [count, ms]
    host_waits: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    copies_to_host: int = 0
    gpu_events: int = 0

    @property
    def gpu_idle_pct(self) -> float:
        return 100 * max(self.wall_ms - self.gpu_busy_ms, 0.0) / self.wall_ms if self.wall_ms else 0


def summarize(trace: dict, step: int | None = None) -> StepSummary:
    """The traced step (``ProfilerStep#<step>``, else the last one) of a torch.profiler
    Chrome trace. GPU work is attributed to the step by its start time."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [  # the host's step marks (the GPU has its own copy of each)
        e
        for e in events
        if e.get("name", "").startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation"
    ]
    if not steps:
        raise ValueError("no ProfilerStep# event: not a trace of a profiled training step")
    if step is None:
        mark = max(steps, key=lambda e: e["ts"])
    else:
        chosen = [e for e in steps if e["name"] == f"ProfilerStep#{step}"]
        if not chosen:
            held = ", ".join(
                sorted(
                    (e["name"].removeprefix("ProfilerStep#") for e in steps),
                    key=lambda n: (len(n), n),
                )
            )
            raise ValueError(
                f"no ProfilerStep#{step} in the trace (it holds {held}: torch counts the steps "
                "of this run's profiler from 0, one less than iteration_N's N from a fresh start)"
            )
        mark = chosen[0]
    lo, hi = mark["ts"], mark["ts"] + mark["dur"]
    # GPU work launched in the step can end after the host's step mark: extend to its end.
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and lo <= e["ts"] < hi]
    end = max([hi, *(e["ts"] + e["dur"] for e in gpu)])
    summary = StepSummary(
        wall_ms=(end - lo) / 1e3, gpu_busy_ms=_union(gpu) / 1e3, gpu_events=len(gpu)
    )
    kernels: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e in gpu:
        if e["cat"] == "kernel":
            kernels[e["name"]] += e["dur"] / 1e3
            counts[e["name"]] += 1
        elif e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]:
            summary.copies_to_host += 1
    summary.kernels_ms, summary.kernel_counts = dict(kernels), dict(counts)
    ops = [e for e in events if e.get("cat") == "cpu_op" and lo <= e["ts"] < hi]
    for e in events:
        if e.get("cat") != "cuda_runtime" or not lo <= e["ts"] < hi:
            continue
        blocking_copy = e["name"].startswith("cudaMemcpy") and not e["name"].endswith("Async")
        if e["name"] in HOST_WAITS or blocking_copy:
            key = (e["name"], _innermost(ops, e))
            count, ms = summary.host_waits.get(key, [0, 0.0])
            summary.host_waits[key] = [count + 1, ms + e["dur"] / 1e3]
    return summary


def _union(events: list[dict]) -> float:
    """Microseconds covered by at least one of ``events`` (kernels on several streams
    overlap)."""
    total, reach = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop <= reach:
            continue
        total += stop - max(start, reach)
        reach = stop
    return total


def _innermost(ops: list[dict], call: dict) -> str:
    """The innermost operator of the calling thread that encloses a runtime call."""
    around = [
        o for o in ops if o["tid"] == call["tid"] and o["ts"] <= call["ts"] <= o["ts"] + o["dur"]
    ]
    return min(around, key=lambda o: o["dur"])["name"] if around else "(no operator)"


def report(summary: StepSummary, top: int = 12) -> str:
    if not summary.gpu_events:
        return f"step {summary.wall_ms:,.1f} ms; no GPU activity in this trace (a CPU run)"
    lines = [
        f"step {summary.wall_ms:,.1f} ms; GPU busy {summary.gpu_busy_ms:,.1f} ms, "
        f"idle {summary.gpu_idle_pct:.1f}%; {summary.copies_to_host} copies to the host"
    ]
    if summary.host_waits:
        lines.append("host waits for the GPU (call, from operator: count, ms):")
        for (call, op), (count, ms) in sorted(summary.host_waits.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {call}, from {op}: {int(count)}, {ms:,.2f}")
    else:
        lines.append("no host waits for the GPU in the step")
    lines.append(f"top kernels (ms, calls) of {sum(summary.kernels_ms.values()):,.1f} ms:")
    for name, ms in sorted(summary.kernels_ms.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {ms:8.2f} {summary.kernel_counts[name]:5d}  {name[:100]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path, help="a rank's *_trace.json from --profiling")
    parser.add_argument("--step", type=int, help="which ProfilerStep# (default: the last)")
    parser.add_argument("--top", type=int, default=12, help="kernels to list")
    args = parser.parse_args()
    print(report(summarize(json.loads(args.trace.read_text()), args.step), args.top))


if __name__ == "__main__":
    main()

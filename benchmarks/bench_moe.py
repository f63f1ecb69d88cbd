"""Mixture of experts on this CPU: tokens/s, peak memory and the all-to-all share of a step.

    python benchmarks/bench_moe.py                          # 1 process, EP 2, EP 2 x FSDP 2
    python benchmarks/bench_moe.py --layouts ep2 --steps 20 --seq_len 512
    python benchmarks/bench_moe.py --config qwen3_moe_debugmodel   # Qwen3's MoE
    python benchmarks/bench_moe.py --force_load_balance     # every expert the same routings

Runs ``--config`` (``deepseek_v3_debugmodel``, or ``qwen3_moe_debugmodel``) through
``run_train.sh`` per layout (one after the other),
``--batch`` sequences of ``--seq_len`` tokens per data-parallel rank, fp32, and traces step
``--steps - 1`` of rank 0 with torch.profiler. Printed per layout: median tokens/s per rank
of the steps after ``--warmup``, rank 0's peak RSS, and the share of the traced step's wall
time inside the expert-parallel all-to-alls (the union of the intervals of every profiled
operator whose name has ``all_to_all``/``alltoall``, on the step's thread), and the busiest
expert's routings over the mean (median over the kept steps of the run's
``moe_load_max_over_mean``). ``--force_load_balance`` measures with every expert routed the
same number of tokens (``--moe.force_load_balance``): the cost of the layout without the
imbalance of a young router.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    # name: (ranks, flags); the global batch is batch x data-parallel ranks
    "1proc": (1, []),
    "fsdp2": (2, []),
    "ep2": (2, ["--parallelism.expert_parallel_degree", "2"]),
    "ep2_fsdp2": (4, ["--parallelism.expert_parallel_degree", "2"]),
}
CONFIGS = {"deepseek_v3_debugmodel": "deepseek_v3", "qwen3_moe_debugmodel": "qwen3"}
"""The debug MoE configs, with their module."""
ALL_TO_ALL = re.compile(r"all_?to_?all", re.IGNORECASE)


def all_to_all_share(trace: Path) -> float:
    """Fraction of the profiled step's wall time covered by all-to-all operators."""
    events = json.loads(trace.read_text())["traceEvents"]
    step = next(e for e in events if e.get("name", "").startswith("ProfilerStep#"))
    lo, hi = step["ts"], step["ts"] + step["dur"]
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X"
        and e.get("tid") == step["tid"]
        and ALL_TO_ALL.search(e.get("name", ""))
        and lo <= e["ts"] < hi
    )
    covered, end = 0.0, lo
    for start, stop in spans:  # union of intervals
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered / step["dur"]


def run(
    args: argparse.Namespace, ranks: int, flags: list[str]
) -> tuple[float, float, float, float]:
    with tempfile.TemporaryDirectory() as dump:
        traced = args.steps - 1
        cmd = [
            "./run_train.sh",
            "--training.steps", str(args.steps),
            "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch),
            "--metrics.log_freq", "1",
            "--checkpoint.no_enable",
            "--debug.seed", "0",
            "--profiling.enable_profiling",
            "--profiling.profile_freq", str(traced),
            "--profiling.profiler_warmup", "1",
            "--profiling.profiler_active", "1",
            "--job.dump_folder", dump,
            *flags,
            *(["--moe.force_load_balance"] if args.force_load_balance else []),
        ]  # fmt: skip
        env = os.environ | {
            "NGPU": str(ranks),
            "PYTHON": sys.executable,
            "MODULE": CONFIGS[args.config],
            "CONFIG": args.config,
        }
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
        records = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
        trace = Path(dump) / "profile_traces" / f"iteration_{traced}" / "rank0_trace.json"
        share = all_to_all_share(trace)
    # The traced step is slower (the profiler's own cost): leave it out of the speed.
    kept = [r for r in records if r["step"] > args.warmup and r["step"] != traced]
    tps = statistics.median(r["tps"] for r in kept)
    load = statistics.median(r["moe_load_max_over_mean"] for r in kept)
    return tps, max(r["memory_peak_gib"] for r in records), share, load


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", choices=list(CONFIGS), default="deepseek_v3_debugmodel")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--force_load_balance", action="store_true")
    args = parser.parse_args()
    print(
        f"{args.config}, {args.batch} x {args.seq_len} per data-parallel rank, fp32, "
        f"{args.steps} steps (median of steps {args.warmup + 1}+, traced step left out), "
        f"routing {'forced even' if args.force_load_balance else 'learned'}"
    )
    print(
        f"{'layout':<12}{'ranks':>6}{'tok/s/rank':>12}{'peak RSS':>10}{'all-to-all':>12}"
        f"{'load max/mean':>15}"
    )
    for name in args.layouts:
        ranks, flags = LAYOUTS[name]
        tps, rss, share, load = run(args, ranks, flags)
        print(
            f"{name:<12}{ranks:>6}{tps:>12,.0f}{rss:>8.2f} G{100 * share:>11.1f}%{load:>15.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

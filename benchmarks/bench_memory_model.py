"""The dry run's memory estimate against a real run's measured peak, layout by layout.

    python benchmarks/bench_memory_model.py
    python benchmarks/bench_memory_model.py --layouts fsdp2 tp2 --seq_len 1024

For each layout: ``COMM_MODE=fake_backend`` estimates rank 0's memory (parameters, gradients,
optimizer state exact; the step's peak from 1- and 2-block probes), then a real run of the
same config records the CPU memory timeline of a step after the first (torch.profiler's
memory categories: what the allocator holds, comparable to the estimate), and rank 0's peak
RSS (which adds the interpreter, torch's libraries and the allocator's slack). Printed:
estimated and measured activations and peak, and the estimate's error on each. Where torch
cannot categorize the step's memory (FSDP on CPU, torch 2.13) only the peak of the profiler's
allocation events is measured (activations: nan).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
LAYOUTS = {
    # name: (ranks, module, config, flags)
    "1proc": (1, "llama3", "llama3_debugmodel", []),
    "fsdp2": (2, "llama3", "llama3_debugmodel", []),
    "tp2": (2, "llama3", "llama3_debugmodel", ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_ac": (2, "llama3", "llama3_debugmodel", ["--activation_checkpoint.mode", "full"]),
    "moe_ep2": (
        2,
        "deepseek_v3",
        "deepseek_v3_debugmodel",
        ["--parallelism.expert_parallel_degree", "2"],
    ),
}


def _gib(out: str, label: str) -> float:
    match = re.search(rf"{label}\s+([\d.]+) (GiB|MiB)", out)
    if not match:
        sys.exit(f"no {label!r} in the dry run's output:\n{out[-3000:]}")
    return float(match.group(1)) / (1 if match.group(2) == "GiB" else 1024)


def _run(ranks: int, module: str, config: str, flags: list[str], **env: str):
    full_env = os.environ | {
        "NGPU": str(ranks),
        "PYTHON": sys.executable,
        "MODULE": module,
        "CONFIG": config,
    }
    out = subprocess.run(
        ["./run_train.sh", *flags], cwd=REPO, env=full_env | env, capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"run_train.sh {' '.join(flags)} failed:\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr


def measure(args: argparse.Namespace, name: str) -> dict[str, float]:
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, Category

    ranks, module, config, layout = LAYOUTS[name]
    common = [
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch),
        "--checkpoint.no_enable", "--debug.seed", "0",
        *layout,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as dump:
        dry = _run(
            ranks, module, config, [*common, "--job.dump_folder", f"{dump}/dry"],
            COMM_MODE="fake_backend", RANK="0",
        )  # fmt: skip
        real = f"{dump}/real"
        _run(
            ranks, module, config,
            [*common, "--job.dump_folder", real, "--training.steps", "2",
             "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2",
             "--profiling.profiler_warmup", "0",
             "--metrics.log_freq", "1"],
        )  # fmt: skip
        folder = Path(real) / "memory_snapshot" / "iteration_2"
        timeline, trace = folder / "rank0_memory_timeline.json", folder / "rank0_memory_trace.json"
        if timeline.is_file():
            _, sizes = json.loads(timeline.read_text())
            activation = _CATEGORY_TO_INDEX[Category.ACTIVATION] + 1  # column 0 is unused
            act = max(row[activation] for row in sizes) / GiB
            peak = max(sum(row) for row in sizes) / GiB
        else:  # torch could not categorize the step (FSDP on CPU): allocation events only
            events = json.loads(trace.read_text())["traceEvents"]
            totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
            act, peak = float("nan"), max(totals) / GiB
        records = [json.loads(x) for x in (Path(real) / "metrics.jsonl").read_text().splitlines()]
    return {
        "est_act": _gib(dry, "Activation"),
        "est_peak": _gib(dry, "peak of a step"),
        "act": act,
        "peak": peak,
        "rss": max(r["memory_peak_gib"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=2048)
    args = parser.parse_args()
    print(f"debug models, {args.batch} x {args.seq_len} per rank, fp32, rank 0 (GiB)")
    print(
        f"{'layout':<10}{'act est':>9}{'act real':>10}{'err':>7}"
        f"{'peak est':>10}{'peak real':>11}{'err':>7}{'RSS':>7}"
    )
    for name in args.layouts:
        m = measure(args, name)
        act_err = 100 * (m["est_act"] / m["act"] - 1)
        peak_err = 100 * (m["est_peak"] / m["peak"] - 1)
        print(
            f"{name:<10}{m['est_act']:>9.3f}{m['act']:>10.3f}{act_err:>+6.0f}%"
            f"{m['est_peak']:>10.3f}{m['peak']:>11.3f}{peak_err:>+6.0f}%{m['rss']:>7.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

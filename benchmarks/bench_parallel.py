"""Throughput and per-rank memory of the debug model at 1, 2 (FSDP, PP) and 4 (FSDP x TP) ranks.

    python benchmarks/bench_parallel.py                 # fp32, global batch 8 x 512 tokens
    python benchmarks/bench_parallel.py --seq_len 2048 --steps 6

Each layout trains the same global batch per step through ``run_train.sh``. Printed per layout:
median tokens/s per device and in total over the steps after warm-up, the ratio of total
throughput to one process, this rank's parameter and optimizer-state MiB (what FSDP shards),
and peak RSS per rank.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYOUTS = {
    "1 process": (1, []),
    "FSDP 2": (2, []),
    "FSDP 2 x TP 2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    **{
        f"PP 2 {schedule}": (
            2,
            ["--parallelism.pipeline_parallel_degree", "2"]
            + ["--parallelism.pipeline_parallel_schedule", schedule],
        )
        for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
    },
}


def run(ranks: int, flags: list[str], args: argparse.Namespace) -> list[dict]:
    split = [f for f in flags if f.endswith(("tensor_parallel_degree", "pipeline_parallel_degree"))]
    dp = ranks // 2 ** len(split)
    local = args.global_batch // dp
    if "--parallelism.pipeline_parallel_degree" in flags:
        # Pipeline micro-batches of local / pp_microbatches sequences.
        flags = [*flags, "--parallelism.pipeline_parallel_microbatch_size"]
        flags.append(str(max(1, local // args.pp_microbatches)))
    with tempfile.TemporaryDirectory() as dump:
        cmd = [
            "./run_train.sh",
            "--training.steps", str(args.steps),
            "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(local),
            "--training.mixed_precision_param", args.dtype,
            "--metrics.log_freq", "1",
            "--metrics.save_for_all_ranks",
            "--metrics.no_enable_color_printing",
            "--job.dump_folder", dump,
            *flags,
        ]  # fmt: skip
        env = os.environ | {"NGPU": str(ranks), "PYTHON": sys.executable}
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
        files = sorted(Path(dump).glob("metrics_rank*.jsonl"))
        return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--pp_microbatches", type=int, default=4, help="per accumulation batch")
    parser.add_argument("--only", nargs="*", help="run only these layouts (names as printed)")
    args = parser.parse_args()
    print(
        f"global batch {args.global_batch} x {args.seq_len} tokens, {args.dtype}, {os.cpu_count()} CPUs"
    )
    header = f"{'layout':>22} {'tok/s/device':>13} {'tok/s total':>12} {'vs 1 proc':>10} {'param MiB':>10} {'optim MiB':>10} {'peak RSS GiB':>13}"
    print(header)
    baseline = None
    for name, (ranks, flags) in LAYOUTS.items():
        if args.only and name not in args.only and name != "1 process":
            continue
        ranks_records = run(ranks, flags, args)
        rank0 = ranks_records[0]
        tps = statistics.median(r["tps"] for r in rank0[args.warmup :])
        total = tps * ranks
        baseline = baseline or total
        rss = max(records[-1]["memory_peak_gib"] for records in ranks_records)
        print(
            f"{name:>22} {tps:>13,.0f} {total:>12,.0f} {total / baseline:>10.2f} "
            f"{rank0[0]['param_mib']:>10.1f} {rank0[0]['optimizer_state_mib']:>10.1f} {rss:>13.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

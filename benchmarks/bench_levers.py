"""CPU throughput levers of ``run_train.sh``, one at a time, each against the same baseline.

    python benchmarks/bench_levers.py                          # 1 process, 4 x 512, fp32
    python benchmarks/bench_levers.py --ranks 2 --levers threads_2 reshard_never foreach
    python benchmarks/bench_levers.py --batch 8 --seq_len 2048 --steps 8 --warmup 3

Each lever is one change to the baseline run (debug model, ``--ranks`` processes with FSDP
when 2+, the given batch, length and precision, logging every ``--log_freq`` steps). A lever
run and a baseline run alternate ``--reps`` times, so the machine's drift hits both; kernel
speed also differs from process to process by a few percent, so the effect printed is the
median of the reps' paired ratios (lever / baseline tokens/s per rank, median of the steps
after ``--warmup``). Also printed: the baseline's share of step time spent waiting for data.
"""

import argparse
import statistics

from train_runs import train_records

LEVERS: dict[str, tuple[list[str], dict[str, str], str]] = {
    # name: (extra flags, extra environment, what it changes)
    "threads_1": ([], {"OMP_NUM_THREADS": "1"}, "1 intra-op thread per rank"),
    "threads_2": ([], {"OMP_NUM_THREADS": "2"}, "2 intra-op threads per rank"),
    "foreach": (["--optimizer.implementation", "foreach"], {}, "foreach AdamW (not fused)"),
    "for_loop": (["--optimizer.implementation", "for-loop"], {}, "per-parameter AdamW"),
    "compile": (["--compile.enable"], {}, "torch.compile of blocks and loss (inductor)"),
    "bf16": (["--training.mixed_precision_param", "bfloat16"], {}, "bf16 compute"),
    "fp32": (["--training.mixed_precision_param", "float32"], {}, "fp32 compute"),
    "bf16_params": (
        ["--training.dtype", "bfloat16"],
        {},
        "bf16 parameters, gradients and AdamW moments (bf16 compute)",
    ),
    "reshard_never": (
        ["--parallelism.fsdp_reshard_after_forward", "never"],
        {},
        "FSDP keeps gathered blocks from forward to backward",
    ),
    "prefetch_1": (["--parallelism.fsdp_prefetch", "1"], {}, "FSDP gathers the next block early"),
    "prefetch_2": (["--parallelism.fsdp_prefetch", "2"], {}, "FSDP gathers 2 blocks early"),
    "simple_fsdp": (["--parallelism.fsdp_impl", "simple"], {}, "per-parameter DTensor FSDP"),
    "gc_off": (["--training.gc_freq", "0"], {}, "no scheduled GC (Python's own)"),
}


def run(args: argparse.Namespace, flags: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Median tokens/s per rank after warm-up, and the mean share of data loading (%)."""
    shape = ["--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len)]
    shape += ["--training.local_batch_size", str(args.batch)]
    shape += ["--training.mixed_precision_param", args.dtype]
    shape += ["--metrics.log_freq", str(args.log_freq)]
    records = train_records([*shape, *flags], ranks=args.ranks, env=env)
    # A record covers the steps since the previous one: keep those wholly after warm-up.
    kept = [r for r in records if r["step"] - args.log_freq >= args.warmup]
    return (
        statistics.median(r["tps"] for r in kept),
        statistics.mean(r["data_loading_pct"] for r in kept),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--log_freq", type=int, default=5)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--levers", nargs="+", choices=sorted(LEVERS), default=["threads_1", "foreach", "compile"]
    )
    args = parser.parse_args()
    print(
        f"baseline: {args.ranks} rank(s){' (FSDP)' if args.ranks > 1 else ''}, "
        f"{args.batch} x {args.seq_len}, {args.dtype}, {args.steps} steps, {args.reps} reps; "
        "tokens/s per rank"
    )
    print(f"{'lever':<16}{'baseline':>10}{'lever':>10}{'effect':>9}  data %  what")
    for name in args.levers:
        flags, env, what = LEVERS[name]
        base, lever, ratios, data = [], [], [], []
        for _ in range(args.reps):
            b, d = run(args, [], {})
            v, _ = run(args, flags, env)
            base.append(b)
            lever.append(v)
            ratios.append(v / b)
            data.append(d)
        print(
            f"{name:<16}{statistics.median(base):>10,.0f}{statistics.median(lever):>10,.0f}"
            f"{100 * (statistics.median(ratios) - 1):>+8.1f}%{statistics.mean(data):>7.1f}  {what}",
            flush=True,
        )


if __name__ == "__main__":
    main()

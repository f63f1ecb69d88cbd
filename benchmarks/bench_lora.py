"""LoRA against full fine-tuning on this CPU: tokens/s, peak memory and optimizer state.

    python benchmarks/bench_lora.py                                 # Qwen3 0.6B, ranks 8 and 64
    python benchmarks/bench_lora.py --module llama3 --flavor debugmodel --ranks 4 16

Runs ``run_train.sh`` in one process per setting, one after the other: full fine-tuning, then
``--lora.rank r`` for each ``--ranks`` (default targets: every block's linear layers), fp32,
``--batch`` x ``--seq_len`` tokens a step from random weights (the speed and memory do not
depend on the values). Printed per setting: trainable parameters, the median tokens/s of the
steps after ``--warmup``, TFLOP/s as the trainer counts them (LoRA: no gradient for the frozen
weights), the optimizer state and the process's peak RSS.
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


def run(args: argparse.Namespace, flags: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [
            "./run_train.sh",
            "--model.flavor", args.flavor,
            "--training.steps", str(args.steps),
            "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch),
            "--training.mixed_precision_param", "float32",
            "--metrics.log_freq", "1",
            "--metrics.no_report",
            "--checkpoint.no_enable",
            "--debug.seed", "0",
            "--job.dump_folder", dump,
            *flags,
        ]  # fmt: skip
        env = os.environ | {
            "NGPU": "1",
            "PYTHON": sys.executable,
            "MODULE": args.module,
            "CONFIG": f"{args.module}_debugmodel",  # the bundled data and tokenizer
        }
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
        records = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
        trainable = next(
            (line for line in out.stderr.splitlines() if "parameters" in line and "Model " in line),
            "",
        )
    kept = [r for r in records if r["step"] > args.warmup]
    return {
        "line": trainable.split("INFO ", 1)[-1],
        "tps": statistics.median(r["tps"] for r in kept),
        "tflops": statistics.median(r["tflops"] for r in kept),
        "optimizer_mib": records[0].get("optimizer_state_mib", 0.0),
        "peak_gib": max(r["memory_peak_gib"] for r in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--module", default="qwen3")
    parser.add_argument("--flavor", default="0.6B")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(
        f"{args.module} {args.flavor}, {args.batch} x {args.seq_len} tokens a step, fp32, one "
        f"process, {args.steps} steps (median of steps {args.warmup + 1}+)"
    )
    settings = [("full fine-tuning", [])]
    settings += [(f"LoRA rank {r}", ["--lora.rank", str(r)]) for r in args.ranks]
    print(f"{'setting':<18} {'tok/s':>8} {'TFLOP/s':>8} {'optim MiB':>10} {'peak RSS':>9}")
    for name, flags in settings:
        m = run(args, flags)
        print(
            f"{name:<18} {m['tps']:>8,.0f} {m['tflops']:>8.3f} {m['optimizer_mib']:>10,.1f} "
            f"{m['peak_gib']:>7.2f} G   ({m['line']})",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Semi-synchronous training against replicas that reduce gradients every step, on this CPU.

    python benchmarks/bench_semi_sync.py                      # 2 replicas, 100 steps, H = 10
    python benchmarks/bench_semi_sync.py --steps 200 --sync_steps 20 --fragments 2

Runs ``NGPU=2 ./run_train.sh`` (two replicas of one rank each: ``--parallelism.
data_parallel_replicate_degree 2``) once per setting, one after the other, from the same
weights on the same data, in float32: replicated data parallelism (gradients all-reduced every step), then
``--semi_sync.method local_sgd``, ``diloco`` and streaming ``diloco`` with ``--fragments``.
Printed per setting: the bytes each rank sends to the other replica per step (the gradient
all-reduce in float32, or one fragment's weights or pseudo-gradient in float32 per meeting,
spread over the steps), the median tokens/s after ``--warmup`` steps, and the mean training
loss of the last 10 steps and the validation loss after the last step (the bundled split).
On one machine the links between replicas are this machine's memory: the tokens/s say what the
step costs here, not what a slow link between data centres would cost.
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
            "--training.steps", str(args.steps),
            "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch),
            "--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "1",
            "--validation.enable", "--validation.freq", str(args.steps), "--validation.steps", "8",
            "--validation.sample_prompt", "",
            # float32 compute: replicas of one rank have no data-parallel wrapper whose
            # policy would cast to bf16 (autocast would), so every row computes alike.
            "--training.mixed_precision_param", "float32",
            "--metrics.log_freq", "1", "--metrics.no_report",
            "--debug.seed", "0",
            "--job.dump_folder", dump,
            *flags,
        ]  # fmt: skip
        env = os.environ | {"NGPU": "2", "PYTHON": sys.executable}
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
        records = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    params = next(r["param_mib"] for r in steps if "param_mib" in r)  # float32 weights, MiB
    return {
        "params_mib": params,
        "tps": statistics.median(r["tps"] for r in steps if r["step"] > args.warmup),
        "loss": statistics.mean(r["loss"] for r in steps[-10:]),
        "validation": next(r["validation_loss"] for r in reversed(steps) if "validation_loss" in r),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sync_steps", type=int, default=10)
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    h = ["--semi_sync.sync_steps", str(args.sync_steps)]
    settings = [
        ("replicated (all-reduce every step)", [], 1.0),
        (f"local_sgd, H={args.sync_steps}", ["--semi_sync.method", "local_sgd", *h], None),
        (f"diloco, H={args.sync_steps}", ["--semi_sync.method", "diloco", *h], None),
        (
            f"streaming diloco, H={args.sync_steps}, {args.fragments} fragments",
            ["--semi_sync.method", "diloco", *h, "--semi_sync.num_fragments", str(args.fragments)],
            None,
        ),
    ]
    print(
        f"2 replicas x 1 rank, llama3 debugmodel, {args.batch} x {args.seq_len} tokens per rank "
        f"and step, {args.steps} steps"
    )
    print(f"{'setting':48} {'MiB/step sent':>13} {'tok/s/rank':>10} {'loss':>7} {'val loss':>8}")
    for name, flags, per_step in settings:
        result = run(args, flags)
        # Every weight crosses once per H steps (its fragment's meeting), in float32.
        sent = result["params_mib"] * (per_step if per_step else 1 / args.sync_steps)
        print(
            f"{name:48} {sent:13.2f} {result['tps']:10,.0f} {result['loss']:7.4f} "
            f"{result['validation']:8.4f}"
        )


if __name__ == "__main__":
    main()

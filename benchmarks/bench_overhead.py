"""What the framework costs: ``run_train.sh`` against a bare PyTorch loop of the same work.

    python benchmarks/bench_overhead.py                            # 1 process, 4 x 512, fp32
    python benchmarks/bench_overhead.py --batch 8 --seq_len 2048 --dtype bfloat16 --steps 12

The bare loop is the least a user could write for the same step: the same Llama 3 debug model
and initial weights, the same batches of the bundled corpus, bf16 autocast when asked, the
summed cross-entropy over the global token count, gradient-norm clipping, fused AdamW with the
same hyper-parameters and a constant learning rate, nothing else (no metrics, logging,
watchdog, GC control, checkpoint polling). Both run in their own process, alternately
``--reps`` times (run-to-run noise on this machine is several percent); printed: each rep's
median tokens/s of the steps after warm-up, and the overhead from the medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bare_loop(args: argparse.Namespace) -> list[float]:
    """Tokens/s of each step of the bare loop (run in this process)."""
    import torch

    from torchtitan.components.dataloader import build_dataloader
    from torchtitan.components.tokenizer import build_tokenizer
    from torchtitan.models.llama3 import model_spec
    from torchtitan.tools.paths import resolve_path

    torch.manual_seed(0)
    model_args = model_spec.args_for("debugmodel", seq_len=args.seq_len)
    with torch.device("meta"):
        model = model_spec.build_model(model_args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )
    tokenizer = build_tokenizer(resolve_path("tests/assets/tokenizer"))
    loader = build_dataloader(
        dataset="python_docs",
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=args.seq_len,
        local_batch_size=args.batch,
        dp_rank=0,
        dp_world_size=1,
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    tps = []
    batches = iter(loader)
    for _ in range(args.steps):
        start = time.perf_counter()
        inputs, labels = next(batches)
        with autocast:
            logits = model(inputs["input"])
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
                )
                / labels.numel()
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        tps.append(labels.numel() / (time.perf_counter() - start))
    return tps


def framework(args: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [
            "./run_train.sh",
            "--training.steps", str(args.steps),
            "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch),
            "--training.mixed_precision_param", args.dtype,
            "--lr_scheduler.warmup_steps", "0",
            "--lr_scheduler.decay_type", "constant",
            "--metrics.log_freq", str(args.log_freq),
            "--checkpoint.no_enable",
            "--debug.seed", "0",
            "--job.dump_folder", dump,
        ]  # fmt: skip
        env = os.environ | {"NGPU": "1", "PYTHON": sys.executable}
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
        records = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    # A record covers the steps since the previous one: keep those wholly after warm-up.
    return [r["tps"] for r in records if r["step"] - args.log_freq >= args.warmup]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument(
        "--log_freq", type=int, default=1, help="run_train.sh logs (and syncs) every N steps"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:  # the bare loop, in a process of its own
        print(json.dumps(bare_loop(args)))
        return
    bare_cmd = [sys.executable, __file__, "--bare", *sys.argv[1:]]
    bare, ours = [], []
    for rep in range(args.reps):  # alternate, so drifts of the machine hit both alike
        out = subprocess.run(bare_cmd, cwd=REPO, check=True, capture_output=True, text=True)
        bare.append(statistics.median(json.loads(out.stdout.splitlines()[-1])[args.warmup :]))
        ours.append(statistics.median(framework(args)))
        print(f"rep {rep + 1}: bare loop {bare[-1]:,.0f} tok/s, run_train.sh {ours[-1]:,.0f}")
    b, o = statistics.median(bare), statistics.median(ours)
    print(
        f"{args.batch} x {args.seq_len}, {args.dtype}, 1 process, median of steps "
        f"{args.warmup + 1}-{args.steps} and of {args.reps} reps: bare loop {b:,.0f} tok/s, "
        f"run_train.sh {o:,.0f} tok/s (logging every {args.log_freq} steps), framework "
        f"overhead {100 * (b / o - 1):+.1f}%"
    )


if __name__ == "__main__":
    main()

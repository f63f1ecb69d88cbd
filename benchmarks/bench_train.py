"""Framework overhead: median tokens/s of the trainer vs a bare PyTorch loop, same model and data.

    python benchmarks/bench_train.py                      # both shapes, bf16 compute
    python benchmarks/bench_train.py --shapes 4x512 --steps 8 --dtype float32

For each shape (local batch x sequence length) it runs ``Trainer.train()`` (data loading,
metrics, logging included) and a hand-written loop over batches already in memory (model
forward, summed cross-entropy / tokens, backward, clip, fused AdamW, LR step), then prints the
median step time of the steps after warm-up, tokens/s, and framework / bare throughput.

Whichever loop runs first in a process is slower for several steps (the allocator maps and
faults in the large activation buffers anew), so the two alternate order over ``--rounds``.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan.config.manager import parse_args
from torchtitan.models.llama3.model import Transformer
from torchtitan.tools.logging import init_logger
from torchtitan.trainer import Trainer


def _config_args(batch: int, seq: int, steps: int, dtype: str, dump: str) -> list[str]:
    return [
        "--training.local_batch_size", str(batch),
        "--training.seq_len", str(seq),
        "--training.steps", str(steps),
        "--training.mixed_precision_param", dtype,
        "--metrics.log_freq", "1",
        "--metrics.no_enable_color_printing",
        "--debug.seed", "0",
        "--job.dump_folder", dump,
    ]  # fmt: skip


def framework_step_times(batch: int, seq: int, steps: int, dtype: str) -> list[float]:
    with tempfile.TemporaryDirectory() as dump:
        trainer = Trainer(
            parse_args(_config_args(batch, seq, steps, dtype, dump), console_outputs=False)
        )
        trainer.train()
        trainer.close()
        records = [
            json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()
        ]
    return [r["step_time_s"] for r in records]


def bare_step_times(batch: int, seq: int, steps: int, dtype: str) -> list[float]:
    """The same work with nothing but torch: prebuilt batches, no metrics, no logging."""
    with tempfile.TemporaryDirectory() as dump:
        trainer = Trainer(
            parse_args(_config_args(batch, seq, steps, dtype, dump), console_outputs=False)
        )
        data = iter(trainer.dataloader)
        batches = [next(data) for _ in range(steps)]
        trainer.close()
    torch.manual_seed(0)
    model = Transformer(trainer.model_args)
    with torch.no_grad():
        model.init_weights()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    times = []
    for inputs, labels in batches:
        start = time.perf_counter()
        optimizer.zero_grad()
        with autocast:
            logits = model(inputs["input"])
        loss = (
            F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            / labels.numel()
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss.item()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["8x2048", "4x512"], help="BATCHxSEQ")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of alternating order")
    args = parser.parse_args()
    init_logger()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}")
    print(f"{'shape':>8} {'framework tok/s':>16} {'bare tok/s':>12} {'ratio':>7}")
    for shape in args.shapes:
        batch, seq = (int(x) for x in shape.split("x"))
        tokens = batch * seq
        runs = {"framework": framework_step_times, "bare": bare_step_times}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for round_ in range(args.rounds):
            for name in sorted(runs, reverse=round_ % 2 == 1):
                times[name] += runs[name](batch, seq, args.steps, args.dtype)[args.warmup :]
        fw, bare = statistics.median(times["framework"]), statistics.median(times["bare"])
        print(
            f"{shape:>8} {tokens / fw:>16,.0f} {tokens / bare:>12,.0f} {bare / fw:>7.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Activation checkpointing by memory budget (``--activation_checkpoint.mode memory_budget``)
against no checkpointing and full checkpointing, all compiled (inductor), on this machine.

    python benchmarks/bench_memory_budget.py                       # 1 process, 4 x 512
    python benchmarks/bench_memory_budget.py --budgets 1 0.5 0 --batch 8 --seq_len 1024

For each setting it prints what the compiled blocks keep for backward in one step (measured in
this process: every tensor saved for backward that is not a parameter, through autograd's
saved-tensor hooks, on the debug model at the given batch and length), then the median
tokens/s after ``--warmup`` steps of a real run (``run_train.sh``, one process) and that run's
peak memory (RSS on a CPU: it also holds the compile's own memory, so activations show less
there than in the first column).
"""

import argparse
import dataclasses
import statistics

from train_runs import train_records


def settings(budgets: list[float]) -> list[tuple[str, list[str], float | None, str]]:
    """(name, flags, budget for the in-process measurement, AC mode there)."""
    rows = [("no AC", [], None, "none")]
    for b in budgets:
        flags = ["--activation_checkpoint.mode", "memory_budget"]
        rows.append(
            (f"budget {b:g}", [*flags, "--activation_checkpoint.memory_budget", str(b)], b, "mb")
        )
    rows.append(("full AC", ["--activation_checkpoint.mode", "full"], None, "full"))
    return rows


def saved_bytes(batch: int, seq_len: int, budget: float | None, mode: str) -> int:
    """Bytes kept for backward by one forward of the compiled debug model (not parameters)."""
    import torch

    from torchtitan.config.job_config import ActivationCheckpoint, Compile
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.llama3 import flavors
    from torchtitan.models.llama3.model import Transformer

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(flavors["debugmodel"], max_seq_len=seq_len))
    model.init_weights()
    ac_mode = {"none": "none", "full": "full", "mb": "memory_budget"}[mode]
    apply_ac(model.layers, ActivationCheckpoint(mode=ac_mode))
    apply_compile(model.layers, Compile(enable=True), memory_budget=budget)
    weights = {p.data_ptr() for p in model.parameters()}
    saved = [0]

    def pack(t):
        if t.data_ptr() not in weights:
            saved[0] += t.numel() * t.element_size()
        return t

    tokens = torch.randint(0, model.args.vocab_size, (batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return saved[0]


def run(args: argparse.Namespace, flags: list[str]) -> tuple[float, float]:
    """Median tokens/s after warm-up, and peak memory (GiB), of one compiled run."""
    shape = ["--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len)]
    shape += ["--training.local_batch_size", str(args.batch), "--metrics.log_freq", "1"]
    records = train_records([*shape, "--compile.enable", *flags])
    kept = [r for r in records if r["step"] > args.warmup]
    return statistics.median(r["tps"] for r in kept), max(r["memory_peak_gib"] for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.2, 0.0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    print(f"debug model, 1 process, {args.batch} x {args.seq_len}, compiled (inductor)")
    print(f"{'setting':<12} {'kept for backward':>18} {'tokens/s':>9} {'peak memory':>12}")
    for name, flags, budget, mode in settings(args.budgets):
        kept = saved_bytes(args.batch, args.seq_len, budget, mode)
        tps, peak = run(args, flags)
        print(f"{name:<12} {kept / 2**20:>14.1f} MiB {tps:>9,.0f} {peak:>8.2f} GiB")


if __name__ == "__main__":
    main()

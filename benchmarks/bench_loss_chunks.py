"""Memory and time of the cross-entropy (forward and backward) at a large vocabulary, in one
piece and in chunks of tokens (``--training.loss_chunks``).

    python benchmarks/bench_loss_chunks.py                       # 2,048 tokens x 128,256, bf16
    python benchmarks/bench_loss_chunks.py --tokens 4096 --chunks 1 8 --dtype float32

Each setting runs in a fresh process (the peak RSS of a process never goes down) and reports
the peak RSS above the logits it was given, and the median time of 3 forward + backward passes.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def measure(tokens: int, vocab: int, dtype: str, chunks: int) -> dict:
    import torch

    from torchtitan.components.loss import cross_entropy_sum

    torch.manual_seed(0)
    logits = torch.randn(1, tokens, vocab, dtype=getattr(torch, dtype)).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        start = time.perf_counter()
        cross_entropy_sum(logits, labels, chunks=chunks).backward()
        times.append(time.perf_counter() - start)
        logits.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logits_mib = logits.numel() * logits.element_size() / 2**20
    return {
        "above_mib": (peak - baseline) / 1024,
        "s": statistics.median(times),
        "logits_mib": logits_mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child's setting
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.tokens, args.vocab, args.dtype, args.one)))
        return
    print(f"cross-entropy of {args.tokens:,} tokens x {args.vocab:,} vocabulary, {args.dtype}")
    print(f"{'chunks':>6} {'peak RSS above the logits':>26} {'forward+backward':>17}")
    for chunks in args.chunks:
        cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--vocab", str(args.vocab)]
        cmd += ["--dtype", args.dtype, "--one", str(chunks)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{chunks:>6} {r['above_mib']:>22,.0f} MiB {r['s']:>15.2f} s", flush=True)
    print(f"(the logits themselves: {r['logits_mib']:,.0f} MiB; their gradient is as large)")


if __name__ == "__main__":
    main()

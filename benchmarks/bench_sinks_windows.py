"""gpt-oss's attention on this CPU: sliding windows and sinks, timed against the alternatives.

    python benchmarks/bench_sinks_windows.py                     # 1 x 2048 tokens, window 128
    python benchmarks/bench_sinks_windows.py --seq_len 4096 --window 256 --batch 2

Forward + backward of one attention layer of gpt-oss's head shape (64 query heads of 64, 8 K/V
heads; ``--heads`` to change) on random inputs, fp32 and bf16: the median ms over
``--repeats`` after a warm-up, and the largest difference from the dense-mask result. Rows:

- ``causal``: plain causal SDPA over the whole sequence (what a full-attention block costs);
- ``window: dense mask``: SDPA with a ``[seq, seq]`` causal-and-window boolean mask (the plain
  exact way: every score computed, then masked);
- ``window: blocks``: ``models.common.sliding_window`` (what a windowed block runs: blocks of
  queries over the keys their window reaches);
- ``causal + sinks``, ``window: blocks + sinks``: the same with a sink per head
  (``models.common.attention.with_sink``: one extra key and one extra column).
"""

import argparse

import torch
import torch.nn.functional as F
from bench_attention import fwd_bwd_ms

from torchtitan.models.common.attention import ScaledDotProductAttention


def dense_window(q, k, v, window, sinks):
    seq = q.shape[2]
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    mask = (j <= i) & (j > i - window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def variants(window: int):
    causal = ScaledDotProductAttention()
    windowed = ScaledDotProductAttention(window=window)
    return {
        "causal": lambda q, k, v, s: causal(q, k, v),
        "window: dense mask": lambda q, k, v, s: dense_window(q, k, v, window, s),
        "window: blocks": lambda q, k, v, s: windowed(q, k, v),
        "causal + sinks": lambda q, k, v, s: causal(q, k, v, sinks=s),
        "window: blocks + sinks": lambda q, k, v, s: windowed(q, k, v, sinks=s),
    }


def time_variant(fn, shape, dtype, repeats):
    bs, heads, kv_heads, seq, head_dim = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(bs, heads, seq, head_dim, generator=g).to(dtype).requires_grad_()
    k, v = (
        torch.randn(bs, kv_heads, seq, head_dim, generator=g).to(dtype).requires_grad_()
        for _ in "kv"
    )
    sinks = torch.randn(heads, generator=g).requires_grad_()
    return fwd_bwd_ms(lambda: fn(q, k, v, sinks), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shape = (args.batch, args.heads, args.kv_heads, args.seq_len, args.head_dim)
    print(
        f"{args.batch} x {args.seq_len} tokens, window {args.window}, {args.heads} heads "
        f"({args.kv_heads} K/V) of {args.head_dim}, {torch.get_num_threads()} threads"
    )
    print(f"{'dtype':>9} {'variant':>24} {'fwd+bwd ms':>11} {'max |diff|':>11}")
    for dtype in (torch.float32, torch.bfloat16):
        results = {
            name: time_variant(fn, shape, dtype, args.repeats)
            for name, fn in variants(args.window).items()
        }
        reference = results["window: dense mask"][1]
        for name, (ms, out) in results.items():
            same = name in ("window: dense mask", "window: blocks")
            diff = f"{(out - reference).abs().max().item():.1e}" if same else ""
            print(f"{str(dtype).removeprefix('torch.'):>9} {name:>24} {ms:11.1f} {diff:>11}")


if __name__ == "__main__":
    main()

"""Exact ways to run block-causal (per-document) attention on this CPU, timed side by side.

    python benchmarks/bench_attention.py                       # 8 x 2048, fp32 and bf16
    python benchmarks/bench_attention.py --seq_len 512 --batch 4

The windows are real ones: the bundled corpus packed as training packs it, so the documents
have their real lengths. Each variant runs forward + backward of the debug model's attention
shape (16 query heads, 8 K/V heads, head dim 16) on those windows; printed: median ms over
``--repeats`` after a warm-up, and the largest difference from the dense-mask result.

- ``causal``: plain causal SDPA over the whole window (not per-document: the lower bound);
- ``dense mask``: SDPA with a ``[bs, 1, seq, seq]`` boolean block-causal mask (what
  ``--model.attn_mask block_causal`` runs);
- ``segments``: one causal SDPA call per document (what ``ScaledDotProductAttention`` runs on
  plain CPU tensors in eager mode).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from torchtitan.components.dataloader import build_dataloader, document_ids
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.models.common import attention
from torchtitan.models.common.attention import block_causal_mask
from torchtitan.tools.paths import resolve_path

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 16


def windows(seq_len: int, batch: int) -> tuple[torch.Tensor, int]:
    tokenizer = build_tokenizer(resolve_path("tests/assets/tokenizer"))
    loader = build_dataloader(
        dataset="python_docs",
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=batch,
        dp_rank=0,
        dp_world_size=1,
    )
    inputs, _ = next(iter(loader))
    return inputs["input"], tokenizer.bos_id


def causal(q, k, v, documents):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def dense_mask(q, k, v, documents):
    mask = block_causal_mask(documents)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def segments(q, k, v, documents):
    # What ScaledDotProductAttention runs on plain CPU tensors in eager mode.
    whole = torch.arange(documents.shape[1]).expand(documents.shape[0], -1)
    return attention._per_document(q, k, v, documents, whole, gqa=True)


def time_variant(fn, documents, dtype, repeats):
    bs, seq = documents.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(bs, HEADS, seq, HEAD_DIM, generator=g).to(dtype).requires_grad_()
    k, v = (
        torch.randn(bs, KV_HEADS, seq, HEAD_DIM, generator=g).to(dtype).requires_grad_()
        for _ in "kv"
    )
    return fwd_bwd_ms(lambda: fn(q, k, v, documents), repeats)


def fwd_bwd_ms(call, repeats: int) -> tuple[float, torch.Tensor]:
    """Median ms of ``call()`` and a backward from its output's sum, over ``repeats`` after a
    warm-up; and the last output (float32)."""
    times, out = [], None
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out = call()
        out.float().sum().backward()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:]), out.detach().float()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokens, bos = windows(args.seq_len, args.batch)
    documents = document_ids(tokens, bos)
    per_row = [len(torch.unique(row)) for row in documents]
    print(
        f"{args.batch} x {args.seq_len} tokens, {torch.get_num_threads()} threads; documents "
        f"per window {min(per_row)}-{max(per_row)} (mean {statistics.mean(per_row):.1f})"
    )
    print(f"{'dtype':>9} {'variant':>11} {'fwd+bwd ms':>11} {'max |diff|':>11}")
    for dtype in (torch.float32, torch.bfloat16):
        results = {
            name: time_variant(fn, documents, dtype, args.repeats)
            for name, fn in (("causal", causal), ("dense mask", dense_mask), ("segments", segments))
        }
        reference = results["dense mask"][1]
        for name, (ms, out) in results.items():
            diff = "" if name == "causal" else f"{(out - reference).abs().max().item():.1e}"
            print(f"{str(dtype).removeprefix('torch.'):>9} {name:>11} {ms:11.1f} {diff:>11}")


if __name__ == "__main__":
    main()

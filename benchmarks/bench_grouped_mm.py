"""Routed experts' compute: the grouped GEMM against the loop over experts, forward + backward.

    python benchmarks/bench_grouped_mm.py                      # GPU: 16B and 671B-per-rank sizes
    python benchmarks/bench_grouped_mm.py --shapes debug       # this CPU: the debug model's size

For each shape (model dim, expert hidden dim, experts on this rank, routed rows = tokens x
top-k) and routing (``uniform``: each row's expert drawn uniformly; ``skewed``: expert e drawn
with weight 1 / sqrt(e + 1), the busiest expert getting ~5x the least busy's rows at 64
experts), it times ``GroupedExperts``' three paths in bf16 on rows already sorted by expert:
``loop`` (one matmul chain per expert; reads the counts on the host), ``grouped`` (three
``torch._grouped_mm`` calls; reads the padded row total on the host) and ``grouped_nosync``
(the same with the buffer sized for the most padding there can be: no host read). Printed:
median milliseconds of forward + backward (input and weight gradients) over ``--repeats``
after warm-up, the achieved TFLOP/s (18 x rows x dim x hidden per pass), and on CUDA the
number of device-to-host syncs one pass makes (``torch.cuda.set_sync_debug_mode``).
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchtitan.models.common.experts import _grouped_mm_experts, _loop_experts  # noqa: E402

SHAPES = {
    # name: (dim, hidden, experts, rows)
    "debug": (256, 256, 8, 8 * 512 * 2),
    "16B": (2048, 1408, 64, 8192 * 6),  # DeepSeek-V2-Lite: 64 experts, top 6, 8k tokens
    "671B_ep8": (7168, 2048, 32, 4096 * 8),  # DeepSeek-V3 at EP 8: 32 of 256 experts, top 8
}
PATHS = {
    "loop": _loop_experts,
    "grouped": _grouped_mm_experts,
    "grouped_nosync": lambda *a: _grouped_mm_experts(*a, max_padding=True),
}


def counts_for(rows: int, experts: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    weights = torch.ones(experts)
    if routing == "skewed":
        weights = 1 / torch.arange(1, experts + 1).sqrt()
    ids = torch.multinomial(weights, rows, replacement=True, generator=gen)
    return torch.bincount(ids, minlength=experts)


def time_path(fn, x, counts, weights, repeats: int, device: torch.device) -> float:
    def once():
        out = fn(x, counts, *weights)
        out.sum().backward()

    for _ in range(3):
        once()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_syncs(fn, x, counts, weights) -> int | None:
    if x.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(x, counts, *weights).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None)
    parser.add_argument("--routings", nargs="+", default=["uniform", "skewed"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = args.shapes or (["16B", "671B_ep8"] if device.type == "cuda" else ["debug"])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, bf16, forward + backward")
    print(
        f"{'shape':>9} {'routing':>8} {'path':>15} {'ms':>9} {'TFLOP/s':>8} {'syncs':>6} {'max/mean':>8}"
    )
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        dim, hidden, experts, rows = SHAPES[shape]
        flops = 18 * rows * dim * hidden
        for routing in args.routings:
            counts = counts_for(rows, experts, routing, gen)
            load = (counts.max() / counts.float().mean()).item()
            counts = counts.to(device)
            x = torch.randn(rows, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            weights = [
                (
                    torch.randn(experts, *s, device=device, dtype=torch.bfloat16) * 0.02
                ).requires_grad_()
                for s in ((hidden, dim), (dim, hidden), (hidden, dim))
            ]
            for path, fn in PATHS.items():
                seconds = time_path(fn, x, counts, weights, args.repeats, device)
                syncs = host_syncs(fn, x, counts, weights)
                print(
                    f"{shape:>9} {routing:>8} {path:>15} {seconds * 1e3:>9.2f} "
                    f"{flops / seconds / 1e12:>8.1f} {'-' if syncs is None else syncs:>6} "
                    f"{load:>8.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

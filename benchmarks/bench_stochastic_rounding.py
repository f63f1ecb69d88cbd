"""One AdamW step of a large bf16 parameter: torch's fused kernel (rounding to nearest) against
the stochastic-rounding step (``--optimizer.stochastic_rounding``), whole and in chunks.

    python benchmarks/bench_stochastic_rounding.py                 # 2^26 elements (128 MiB bf16)
    python benchmarks/bench_stochastic_rounding.py --elements 100000000

Each row runs in a fresh process (peak RSS never goes down): the step's memory above what the
parameter, its gradient and the moments hold, and the median time of steps 2-4. Run nothing
else beside it.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def measure(elements: int, mode: str) -> dict:
    import torch
    from torch import nn

    from torchtitan.components import stochastic_rounding
    from torchtitan.components.stochastic_rounding import RoundedAdamW, Rounding

    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(elements, dtype=torch.bfloat16))
    param.grad = torch.randn(elements, dtype=torch.bfloat16)
    if mode == "fused":
        optimizer = torch.optim.AdamW([param], lr=1e-3, fused=True)
    else:
        if mode == "stochastic_whole":
            stochastic_rounding.CHUNK = elements
        optimizer = RoundedAdamW([param], Rounding(0, {id(param): "w"}), lr=1e-3)
    # The high-water mark of what the step keeps (two moments the size of the parameter),
    # made and freed before the first step makes the moments themselves.
    moments = [torch.ones_like(param), torch.ones_like(param)]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del moments
    times = []
    for _ in range(4):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = times[1:]  # the first step also makes the moments
    return {"above_mib": (peak - baseline) / 1024, "s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 26)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.elements, args.measure)))
        return
    held = args.elements * 2 * 4 / 2**20  # bf16 parameter, gradient and two moments
    print(f"{args.elements:,} elements: parameter, gradient and moments hold {held:,.0f} MiB")
    print(f"{'step':28} {'memory above, MiB':>18} {'seconds':>9}")
    rows = {
        "fused": "torch fused AdamW (nearest)",
        "stochastic_whole": "stochastic, whole tensor",
        "stochastic": "stochastic, in chunks",
    }
    for mode, label in rows.items():
        out = subprocess.run(
            [sys.executable, __file__, "--elements", str(args.elements), "--measure", mode],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{label:28} {row['above_mib']:18,.0f} {row['s']:9.3f}")


if __name__ == "__main__":
    main()

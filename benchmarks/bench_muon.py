"""Muon's orthogonalisation of sharded matrices: split among the ranks against repeated on each.

    python benchmarks/bench_muon.py                      # 1 process, then FSDP 2 (gloo)
    python benchmarks/bench_muon.py --ranks 1 2 4 --dim 512 --layers 4

Builds the matrices of ``--layers`` Llama-shaped blocks (``--dim``; attention ``dim x dim``,
keys and values ``dim/4 x dim``, FFN ``ffn x dim`` and back, ``ffn = 3 * dim``), shards each
along its rows as FSDP does (``Shard(0)`` over the ranks) and times the orthogonalisation of
one step's updates, ``--ns_steps`` Newton-Schulz iterations, two ways:

- ``split``: :func:`torchtitan.components.muon.orthogonalised`, what ``Muon`` does:
  each rank orthogonalises its share of every group of same-shaped matrices;
- ``every rank``: what it did before, kept here as the baseline: every rank gathers each whole
  matrix, orthogonalises all of them, and keeps its shard.

Each rank runs one intra-op thread, so ranks x 1 thread fit this machine's cores. Printed: the
median time over ``--reps`` of the slowest rank, the matrices each rank orthogonalised, and the
largest difference between the two ways' results (the same arithmetic: 0).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    ffn, kv = 3 * dim, dim // 4
    block = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (dim, ffn), (ffn, dim)]
    return block * layers


def _rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchtitan.components.muon import orthogonalise, orthogonalised

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ranks, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ranks,))
    torch.manual_seed(0)
    updates = [
        distribute_tensor(torch.randn(shape), mesh, [Shard(0)])
        for shape in _shapes(args.dim, args.layers)
    ]

    def every_rank() -> list[torch.Tensor]:
        out = []
        for u in updates:
            whole = orthogonalise(u.full_tensor(), args.ns_steps)
            out.append(distribute_tensor(whole, mesh, u.placements, src_data_rank=None))
        return out

    counted = []

    def split() -> list[torch.Tensor]:
        done = {id(u): ortho for u, ortho in orthogonalised(updates, lambda u: u, args.ns_steps)}
        return [done[id(u)] for u in updates]

    import torchtitan.components.muon as muon

    def counting(x: torch.Tensor, steps: int, **kwargs) -> torch.Tensor:
        counted.append(x.numel() // (x.shape[-2] * x.shape[-1]))
        return orthogonalise(x, steps, **kwargs)

    times = {}
    for name, fn in (("split", split), ("every rank", every_rank)):
        spent = []
        for rep in range(args.reps + 1):
            dist.barrier()
            start = time.perf_counter()
            result = fn()
            took = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if rep:  # the first is a warm-up
                spent.append(took.item())
        times[name] = (statistics.median(spent), result)
    muon.orthogonalise = counting
    split()
    muon.orthogonalise = orthogonalise
    mine = torch.tensor(sum(counted))
    most = mine.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    diff = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()
        for a, b in zip(times["split"][1], times["every rank"][1], strict=True)
    )
    if rank == 0:
        every, shared = times["every rank"][0], times["split"][0]
        print(
            f"| {ranks} | {len(updates)} | {1000 * every:,.0f} | {1000 * shared:,.0f} | "
            f"{every / shared:.2f}x | {len(updates)} | {most.item()} | {diff:.1e} |",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ns_steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--as_rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank:
        _rank(args)
        return
    print(f"dim {args.dim}, {args.layers} blocks, {args.ns_steps} Newton-Schulz steps, FSDP rows")
    print("| ranks | matrices | every rank (ms) | split (ms) | speed-up | "
          "matrices per rank before | after (most) | max difference |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        flags = ["--dim", str(args.dim), "--layers", str(args.layers)]
        flags += ["--ns_steps", str(args.ns_steps), "--reps", str(args.reps), "--as_rank"]
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", __file__, *flags],
            cwd=REPO, env=env, check=True,
        )  # fmt: skip


if __name__ == "__main__":
    main()

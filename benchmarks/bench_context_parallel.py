"""Context parallelism on this machine: memory and throughput of long sequences, and how load
balancing evens out the ranks' attention work.

    python benchmarks/bench_context_parallel.py                   # both parts, seq 8192
    python benchmarks/bench_context_parallel.py --part attention  # ring attention alone
    python benchmarks/bench_context_parallel.py --part train --seq_len 4096 --steps 4

``attention``: causal attention of the debug model's shape (16 query heads, 8 K/V heads, head
dim 16, one sequence of ``seq_len``) forward and backward on 2 and 4 gloo ranks, load
balancing on and off. Per rank: CPU seconds spent (one thread per rank, so this is the rank's
own compute; gloo's threads add a little) and wall seconds (which include waiting for the
slowest rank). Balanced, the CPU seconds should be even.

``train``: the debug model trained at ``seq_len`` (one sequence per step) by 1 process, CP 2
and CP 4 (with and without load balancing) through ``run_train.sh``: total tokens/s (median
of the steps after warm-up) and every rank's peak RSS. On a 2-core machine CP 4 runs 4 ranks
on 2 cores: its speed says little, its memory is real.

``--attn_mask block_causal``: per-document attention instead (K/V gathered on every rank, each
rank's queries masked by their documents). The attention part packs documents of random
lengths (exponential, mean ``--doc_len``, seeded); the train part reads the bundled corpus.
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
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 16


def packed_documents(seq_len: int, doc_len: int):
    """``[1, seq_len]`` document numbers of documents with exponential lengths (mean
    ``doc_len``), the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(max(1, int(torch.empty(1).exponential_(1 / doc_len, generator=g))))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:seq_len].unsqueeze(0)


def attention_rank(seq_len: int, repeats: int, out: str, attn_mask: str, doc_len: int) -> None:
    """One rank of the attention part (run under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed import context_parallel
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    block_causal = attn_mask == "block_causal"
    documents = (packed_documents(seq_len, doc_len),) if block_causal else ()
    rows = []
    for balance in (True, False):
        module = ScaledDotProductAttention()
        context_parallel.apply_cp(
            [module],
            mesh,
            rotate_method="allgather",
            load_balance=balance,
            gather=block_causal,
        )
        local = seq_len // cp
        q = torch.randn(1, HEADS, local, HEAD_DIM, requires_grad=True)
        k, v = (torch.randn(1, KV_HEADS, local, HEAD_DIM, requires_grad=True) for _ in "kv")
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            module(q, k, v, *documents).sum().backward()
            times.append((time.process_time() - cpu, time.perf_counter() - wall))
        cpu_s = statistics.median(t[0] for t in times[1:])
        wall_s = statistics.median(t[1] for t in times[1:])
        rows.append({"balanced": balance, "cpu_s": cpu_s, "wall_s": wall_s})
    gathered = [None] * cp
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def attention_part(args: argparse.Namespace) -> None:
    what = "ring attention" if args.attn_mask == "causal" else "gathered block-causal attention"
    docs = f" (documents of mean length {args.doc_len})" if args.attn_mask != "causal" else ""
    print(f"\n{what} forward + backward, one sequence of {args.seq_len}{docs}, per rank")
    print(f"{'cp':>3} {'balanced':>9} {'CPU s per rank':>32} {'wall s':>8}")
    for cp in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "attention.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cp}"]
            cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", __file__]
            cmd += ["--part", "attention_rank", "--seq_len", str(args.seq_len), "--out", str(out)]
            cmd += ["--attn_mask", args.attn_mask, "--doc_len", str(args.doc_len)]
            env = os.environ | {"OMP_NUM_THREADS": "1"}
            result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"cp {cp} failed:\n{result.stderr[-3000:]}")
            per_rank = json.loads(out.read_text())
        for i, balanced in enumerate((True, False)):
            cpu = "  ".join(f"{rank[i]['cpu_s']:6.2f}" for rank in per_rank)
            wall = max(rank[i]["wall_s"] for rank in per_rank)
            print(f"{cp:>3} {'yes' if balanced else 'no':>9} {cpu:>32} {wall:8.2f}")


LAYOUTS = {
    "1 process": (1, []),
    "CP 2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "CP 2 unbalanced": (
        2,
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.no_context_parallel_load_balance",
        ],
    ),
    "CP 4": (4, ["--parallelism.context_parallel_degree", "4"]),
    "CP 4 unbalanced": (
        4,
        [
            "--parallelism.context_parallel_degree",
            "4",
            "--parallelism.no_context_parallel_load_balance",
        ],
    ),
}


def train_part(args: argparse.Namespace) -> None:
    print(
        f"\ndebug model, 1 sequence of {args.seq_len} per step, {args.dtype}, {args.steps} "
        f"steps, {args.attn_mask} attention"
    )
    print(f"{'layout':>16} {'tok/s total':>12} {'peak RSS GiB per rank':>28} {'loss':>8}")
    for name, (ranks, flags) in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as dump:
            cmd = [
                "./run_train.sh",
                "--training.steps", str(args.steps),
                "--training.seq_len", str(args.seq_len),
                "--training.local_batch_size", "1",
                "--training.mixed_precision_param", args.dtype,
                "--model.attn_mask", args.attn_mask,
                "--debug.seed", "0",
                "--metrics.log_freq", "1",
                "--metrics.save_for_all_ranks",
                "--job.dump_folder", dump,
                *flags,
            ]  # fmt: skip
            env = os.environ | {"NGPU": str(ranks), "PYTHON": sys.executable}
            subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
            files = sorted(Path(dump).glob("metrics_rank*.jsonl"))
            ranks_records = [[json.loads(x) for x in f.read_text().splitlines()] for f in files]
        steady = ranks_records[0][args.warmup :]
        # Every rank logs tokens per second of its own share: the total is the sum over ranks.
        tps = statistics.median(r["tps"] for r in steady) * ranks
        rss = "  ".join(f"{max(r['memory_peak_gib'] for r in rec):.2f}" for rec in ranks_records)
        print(f"{name:>16} {tps:12,.0f} {rss:>28} {ranks_records[0][-1]['loss']:8.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--part", choices=["all", "attention", "train", "attention_rank"], default="all"
    )
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--attn_mask", choices=["causal", "block_causal"], default="causal")
    parser.add_argument("--doc_len", type=int, default=1024, help="attention part, block_causal")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "attention_rank":
        attention_rank(args.seq_len, args.repeats, args.out, args.attn_mask, args.doc_len)
        sys.stdout.flush()
        # Interpreter teardown with gloo's threads aborts now and then on torch 2.13's CPU
        # build ("terminate called without an active exception"); the trainer exits so too.
        os._exit(0)
    print(f"{os.cpu_count()} CPUs")
    if args.part in ("all", "attention"):
        attention_part(args)
    if args.part in ("all", "train"):
        train_part(args)


if __name__ == "__main__":
    main()

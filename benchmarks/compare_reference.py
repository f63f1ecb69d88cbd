"""Ours against the reference (torchtitan 0.3.0 on this CPU), row by row, at equal work.

    bash ../shared/bench/torchtitan_cpu/tt-recipe.sh setup     # once: the reference's venv
    python benchmarks/compare_reference.py                       # every row, 20 steps
    python benchmarks/compare_reference.py --rows 1x4x512 2x4x512 --steps 20 --reps 3

Rows are ``PROCSxBATCHxSEQ`` (``--dtypes`` picks bfloat16 and/or float32): the debug model, one
process or 2-rank FSDP, ``BATCH`` sequences of ``SEQ`` tokens per rank and step. The two sides
run one after the other, never at once. Equal work: activation checkpointing off on both (the
reference turns selective AC on by default), per-document causal attention on both (the
reference's default; ours ``--model.attn_mask block_causal``), the same batch, sequence
length, precision and steps. What still differs, and is printed: the reference's debug model
has 16 K/V heads where ours has 8 (ours does about 7% fewer FLOPs per token: the ``work``
column scales our tokens/s by that), and the data (its synthetic C4 stand-in and test tokenizer,
our bundled corpus), so losses are not comparable across sides.

Printed per row: median tokens/s per rank of steps 5..N for each side, the ratio, the ratio at
equal FLOPs, peak RSS of the largest process (``/usr/bin/time``), and each side's final loss.
"""

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REF_VENV = Path(os.environ.get("VENV", "/tmp/tt-venv"))
REF_WORK = Path(os.environ.get("WORK", "/tmp/tt-assets"))
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?tps:\s*([\d,]+)")
DEFAULT_ROWS = ["1x4x512", "2x4x512", "1x8x2048", "2x8x2048"]
PROFILED_STEP = 6
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::matmul"}


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, float]:
    """Run ``cmd`` under ``/usr/bin/time -v``: its output and the peak RSS (GiB) of the
    largest process it started."""
    with tempfile.NamedTemporaryFile("r") as stats:
        result = subprocess.run(
            ["/usr/bin/time", "-v", "-o", stats.name, *cmd],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        report = stats.read()
    if result.returncode != 0:
        sys.exit(f"{cmd[0]} failed:\n{result.stderr[-3000:]}")
    kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", report).group(1))
    return result.stdout + result.stderr, kib / 2**20


def ours(
    procs: int, batch: int, seq: int, dtype: str, steps: int, profile: Path | None = None
) -> tuple[list[float], float, float]:
    """``profile``: also trace step ``PROFILED_STEP`` into ``profile/ours.json``."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [
            "./run_train.sh",
            "--training.steps", str(steps),
            "--training.seq_len", str(seq),
            "--training.local_batch_size", str(batch),
            "--training.mixed_precision_param", dtype,
            "--model.attn_mask", "block_causal",
            "--activation_checkpoint.mode", "none",
            "--metrics.log_freq", "1",
            "--checkpoint.no_enable",
            "--debug.seed", "42",
            "--job.dump_folder", dump,
        ]  # fmt: skip
        if profile is not None:
            cmd += [
                "--profiling.enable_profiling", "--profiling.profile_freq", str(PROFILED_STEP),
                "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1",
            ]  # fmt: skip
        env = os.environ | {"NGPU": str(procs), "PYTHON": sys.executable}
        _, rss = timed(cmd, REPO, env)
        if profile is not None:
            trace = (
                Path(dump) / "profile_traces" / f"iteration_{PROFILED_STEP}" / "rank0_trace.json"
            )
            shutil.copy(trace, profile / "ours.json")
        records = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return [r["tps"] for r in records], records[-1]["loss"], rss


def reference(
    procs: int, batch: int, seq: int, dtype: str, steps: int, profile: Path | None = None
) -> tuple[list[float], float, float]:
    """``profile``: also trace step ``PROFILED_STEP`` into ``profile/reference.json``."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [
            str(REF_VENV / "bin" / "torchrun"), "--standalone", f"--nproc_per_node={procs}",
            "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
            "tt_cpu.py", "--module", "llama3", "--config", "llama3_debugmodel",
            "--dump_folder", dump, "--debug.seed", "42",
            "--training.steps", str(steps),
            "--training.seq_len", str(seq),
            "--training.local_batch_size", str(batch),
            "--training.mixed_precision_param", dtype,
            "--metrics.log_freq", "1",
        ]  # fmt: skip
        if procs > 1:
            cmd += ["--parallelism.data_parallel_shard_degree", str(procs)]
            cmd += ["--parallelism.spmd_backend", "partial_dtensor"]
        if profile is not None:
            cmd += [
                "--profiler.enable_profiling", "--profiler.profile_freq", str(PROFILED_STEP),
                "--profiler.profiler_warmup", "1", "--profiler.profiler_active", "1",
            ]  # fmt: skip
        cmd.append("activation-checkpoint:none")
        env = os.environ | {"PATH": f"{REF_VENV / 'bin'}:{os.environ['PATH']}"}
        out, rss = timed(cmd, REF_WORK, env)
        if profile is not None:
            traces = Path(dump) / "profiling" / "traces" / f"iteration_{PROFILED_STEP}"
            with gzip.open(traces / "rank0_trace.json.gz") as f:
                (profile / "reference.json").write_bytes(f.read())
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    steps_seen = [
        (int(s), float(loss), float(t.replace(",", ""))) for s, loss, t in STEP_LINE.findall(plain)
    ]
    return [t for _, _, t in steps_seen], steps_seen[-1][1], rss


def compare_profiles(folder: Path, row: str, dtype: str) -> None:
    """The traced step of both sides, and the operators whose exclusive time differs most."""
    from bench_overhead import print_operators, self_times

    ours_wall, mine = self_times(folder / "ours.json")
    ref_wall, theirs = self_times(folder / "reference.json")
    print(f"\nprofiled step {PROFILED_STEP} of {row} {dtype}: ours {ours_wall:,.1f} ms, "
          f"reference {ref_wall:,.1f} ms")  # fmt: skip
    for name, times in (("ours", mine), ("reference", theirs)):
        matmul = sum(v for k, v in times.items() if k in MATMULS)
        attention = sum(v for k, v in times.items() if "attention" in k or "sdpa" in k.lower())
        print(f"  {name:<10} matmuls {matmul:8.1f} ms, attention {attention:7.1f} ms, "
              f"python/idle {times['(python/idle)']:7.1f} ms")  # fmt: skip
    print_operators(("ref", theirs), ("ours", mine))
    print(f"traces: {folder}/ours.json, {folder}/reference.json (Perfetto or chrome://tracing)")


def flops_ratio() -> float:
    """Reference FLOPs per token / ours: the same debug model with 16 K/V heads instead of 8."""
    import dataclasses

    from torchtitan.models.llama3.args import Llama3Args, flavors

    mine = flavors["debugmodel"]
    theirs = dataclasses.replace(mine, n_kv_heads=None)
    return Llama3Args.flops_per_token(theirs, 2048) / Llama3Args.flops_per_token(mine, 2048)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", nargs="*", default=DEFAULT_ROWS)
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help=f"then trace step {PROFILED_STEP} of one more run of each side on the first row "
        "and dtype into DIR, and compare their operators",
    )
    args = parser.parse_args()
    if not (REF_VENV / "bin" / "torchrun").exists() or not (REF_WORK / "tt_cpu.py").exists():
        sys.exit(
            f"error: no reference in {REF_VENV} / {REF_WORK}: run "
            "`bash ../shared/bench/torchtitan_cpu/tt-recipe.sh setup` first"
        )
    work = flops_ratio()
    print(
        f"{os.cpu_count()} CPUs, {args.steps} steps, median tokens/s per rank of steps "
        f"{args.warmup + 1}-{args.steps}; AC off and per-document attention on both; the "
        f"reference does {work:.3f}x our FLOPs per token"
    )
    header = (
        f"{'row':>9} {'dtype':>9} {'ours tok/s':>11} {'ref tok/s':>10} {'ratio':>6} {'work':>6} "
        f"{'ours RSS':>9} {'ref RSS':>8} {'ours loss':>10} {'ref loss':>9}"
    )
    print(header)
    for row in args.rows:
        procs, batch, seq = map(int, row.split("x"))
        for dtype in args.dtypes:
            mine, theirs = [], []
            for _ in range(args.reps):
                mine.append(ours(procs, batch, seq, dtype, args.steps))
                theirs.append(reference(procs, batch, seq, dtype, args.steps))
            ours_tps = statistics.median(t for tps, _, _ in mine for t in tps[args.warmup :])
            ref_tps = statistics.median(t for tps, _, _ in theirs for t in tps[args.warmup :])
            ratio = ours_tps / ref_tps
            print(
                f"{row:>9} {dtype:>9} {ours_tps:11,.0f} {ref_tps:10,.0f} {ratio:6.2f} "
                f"{ratio / work:6.2f} {max(r for _, _, r in mine):8.2f}G "
                f"{max(r for _, _, r in theirs):7.2f}G {mine[-1][1]:10.4f} {theirs[-1][1]:9.4f}",
                flush=True,
            )
    if args.profile:  # one more run of each side, traced, kept out of the figures above
        folder = Path(args.profile)
        folder.mkdir(parents=True, exist_ok=True)
        procs, batch, seq = map(int, args.rows[0].split("x"))
        ours(procs, batch, seq, args.dtypes[0], PROFILED_STEP, profile=folder)
        reference(procs, batch, seq, args.dtypes[0], PROFILED_STEP, profile=folder)
        compare_profiles(folder, args.rows[0], args.dtypes[0])


if __name__ == "__main__":
    main()

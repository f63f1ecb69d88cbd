"""One GPU: tokens/s, MFU and peak memory of Llama 3 1B and a 4-layer 8B, ours and the reference's.

    python benchmarks/bench_gpu.py                                   # every row, ours only
    python benchmarks/bench_gpu.py --reference /tmp/ref --reference_tokenizer DIR
    python benchmarks/bench_gpu.py --rows 1B 8B_4layers/float8 --steps 30 --json out.json

A row is ``FLAVOR[/VARIANT]``: bf16 (FSDP's mixed precision or autocast), torch.compile of
blocks and loss, selective activation checkpointing per op, plain causal attention, batches of
``--seq_len`` tokens from the bundled corpus, loaded in the step (no dataloader worker, as the
reference: ``--ours_flags=--training.num_workers=1`` adds one on our side); ``/eager`` drops compile, ``/float8`` adds float8
tensorwise linears (all but the output), ``/float8_rowwise`` the rowwise recipe, ``/noac``
drops activation checkpointing, ``/block_causal`` attends per document (ours only:
FlexAttention's block mask on CUDA); variants combine with ``+`` (``1B/block_causal+float8``).
Each row runs in its own ``run_train.sh`` (one rank: no mesh, no FSDP, on both sides), then,
with ``--reference``, in the reference trainer
(``benchmarks/reference_launch.py``) with the same settings.

Printed per row and side: median tokens/s over the steps after ``--warmup``, MFU from those
tokens/s with one FLOP count for both sides (ours: 6 x non-embedding parameters + the output
projection + 12 x layers x heads x head dim x seq for attention) and the device's dense bf16
peak, peak reserved GiB (the caching allocator's), and the loss at the last step. With
``--profile DIR`` our side also traces step ``steps - 2``, keeps the trace in ``DIR`` and prints
what the GPU did in it (``torchtitan.tools.gpu_trace``: idle share, host waits, top kernels);
the profiler slows that step and the two around it, so take tokens/s from a run without it.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BATCH = {"1B": 2, "8B_4layers": 1, "debugmodel": 8}  # debugmodel: a smoke test on CPU
CONFIG = {"1B": "llama3_1b", "8B_4layers": "llama3_8b", "debugmodel": "llama3_debugmodel"}
VARIANTS = ("", "eager", "float8", "float8_rowwise", "noac", "block_causal")


def settings(row: str) -> tuple[str, set[str]]:
    flavor, _, variant = row.partition("/")
    variants = set(variant.split("+"))
    if flavor not in BATCH or not variants <= set(VARIANTS):
        raise SystemExit(
            f"error: row {row!r}: FLAVOR one of {list(BATCH)}, VARIANT of {VARIANTS} (joined by +)"
        )
    return flavor, variants


def common_flags(args: argparse.Namespace, flavor: str, variant: set[str]) -> list[str]:
    """Flags both trainers spell the same way."""
    flags = [
        "--model.flavor", flavor,
        "--training.steps", str(args.steps),
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(BATCH[flavor]),
        "--training.mixed_precision_param", "bfloat16",
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        "--activation_checkpoint.mode", "none" if "noac" in variant else "selective",
        "--activation_checkpoint.selective_ac_option", "op",
    ]  # fmt: skip
    if "eager" not in variant:
        flags += ["--compile.enable"]
    return flags


def run_ours(args: argparse.Namespace, row: str, dump: Path) -> dict:
    flavor, variant = settings(row)
    flags = common_flags(args, flavor, variant) + [
        "--model.tokenizer_path", "tests/assets/tokenizer",
        "--training.dataset", "python_docs",
        "--model.attn_mask", "block_causal" if "block_causal" in variant else "causal",
        "--metrics.no_enable_tensorboard",
        "--metrics.no_report",
        "--metrics.no_enable_color_printing",
        "--job.dump_folder", str(dump),
        "--training.num_workers", "0",  # as the reference; --ours_flags may override
    ]  # fmt: skip
    if variant & {"float8", "float8_rowwise"}:
        recipe = "rowwise" if "float8_rowwise" in variant else "tensorwise"
        flags += ["--float8.enable", "--float8.recipe_name", recipe]
    if args.profile:  # one step near the end, traced (one of the median's steps)
        flags += [
            "--profiling.enable_profiling", "--profiling.profile_freq", str(args.steps - 2),
            "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1",
        ]  # fmt: skip
    flags += [f for flag in args.ours_flags for f in flag.split("=", 1)]
    env = os.environ | {"NGPU": "1", "CONFIG": CONFIG[flavor], "PYTHON": sys.executable}
    out = _run(["./run_train.sh", *flags], env, dump / "ours.log")
    if args.profile:
        _keep_trace(args.profile, row, dump / "profile_traces")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {
        "tps": [r["tps"] for r in records],
        "loss": [r["loss"] for r in records],
        "reserved_gib": max(r.get("memory_peak_reserved_gib", 0.0) for r in records),
        "active_gib": max(r["memory_peak_gib"] for r in records),
        "log_tail": out[-2000:],
    }


_REF_LINE = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)", re.DOTALL
)


def run_reference(args: argparse.Namespace, row: str, dump: Path) -> dict:
    flavor, variant = settings(row)
    if "block_causal" in variant:
        raise RuntimeError("per-document attention is not wired to the reference here")
    flags = common_flags(args, flavor, variant) + [
        "--model.name", "llama3",
        "--model.hf_assets_path", args.reference_tokenizer,
        "--training.dataset", "c4_test",
        "--training.dataset_path", str(REPO / "tests/assets/corpus"),
        "--metrics.disable_color_printing",
        "--job.dump_folder", str(dump),
    ]  # fmt: skip
    if variant & {"float8", "float8_rowwise"}:
        recipe = "rowwise" if "float8_rowwise" in variant else "tensorwise"
        flags += ["--model.converters", "quantize.linear.float8"]
        flags += ["--quantize.linear.float8.recipe_name", recipe]
        flags += ["--quantize.linear.float8.filter_fqns", "output"]
    env = os.environ | {"PYTHONPATH": f"{args.reference}:{os.environ.get('PYTHONPATH', '')}"}
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
    ]
    out = _run(
        [*launch, str(REPO / "benchmarks/reference_launch.py"), *flags], env, dump / "ref.log"
    )
    steps = [m.groups() for m in _REF_LINE.finditer(out)]
    if not steps:
        raise RuntimeError(f"no step lines in the reference's output:\n{out[-3000:]}")
    return {
        "tps": [float(t.replace(",", "")) for _, _, _, t in steps],
        "loss": [float(loss) for _, loss, _, _ in steps],
        "reserved_gib": max(float(m) for _, _, m, _ in steps),
        "log_tail": out[-2000:],
    }


def _run(cmd: list[str], env: dict, log: Path) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    log.write_text(out)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd[:3])}...\n{out[-3000:]}")
    return out


def _keep_trace(folder: Path, row: str, traces: Path) -> None:
    """Copy the traced step's trace to ``folder`` and print what the GPU did in it."""
    from torchtitan.tools import gpu_trace

    found = sorted(traces.glob("iteration_*/rank0_trace.json"))
    if not found:
        print(f"{row}: no trace written under {traces}", flush=True)
        return
    folder.mkdir(parents=True, exist_ok=True)
    kept = folder / f"{_stem(row)}_trace.json"
    kept.write_bytes(found[-1].read_bytes())
    try:
        summary = gpu_trace.report(gpu_trace.summarize(json.loads(kept.read_text())))
    except (ValueError, KeyError) as e:  # the figures stand without it
        summary = f"not summarized: {type(e).__name__}: {e}"
    print(f"-- {row}, traced step ({kept}):\n{summary}", flush=True)


def _keep_logs(folder: Path | None, row: str, side: str, dump: Path) -> None:
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for log in dump.glob("*.log"):
        (folder / f"{_stem(row)}_{side}.log").write_text(log.read_text())


def _stem(row: str) -> str:
    """A row as a file name: ``1B/block_causal+float8`` -> ``1B_block_causal_float8``."""
    return row.replace("/", "_").replace("+", "_")


def flops_per_token(flavor: str, seq_len: int) -> int:
    from torchtitan.models.llama3.args import flavors

    return flavors[flavor].flops_per_token(seq_len)


def peak_flops() -> float | None:
    import torch

    from torchtitan.tools.device import peak_flops as lookup

    return lookup(torch.device("cuda")) if torch.cuda.is_available() else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_rows = ["1B", "1B/float8", "8B_4layers", "8B_4layers/eager", "8B_4layers/float8"]
    parser.add_argument("--rows", nargs="+", default=default_rows)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--reference", help="folder holding the reference's torchtitan package")
    parser.add_argument("--reference_tokenizer", help="folder with the reference's tokenizer.json")
    parser.add_argument("--sides", nargs="+", default=["ours", "reference"])
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--logs", type=Path, help="keep each run's console output here")
    parser.add_argument(
        "--profile", type=Path, help="trace one step of each row (ours) here and summarize it"
    )
    parser.add_argument(
        "--ours_flags", nargs="*", default=[], help="more flags for our side (write --x=v)"
    )
    args = parser.parse_args()
    if args.profile and args.steps < 5:
        raise SystemExit(
            "error: --profile traces step steps - 2 after a warm-up: --steps 5 or more"
        )
    for row in args.rows:
        settings(row)
    sides = [s for s in args.sides if s == "ours" or args.reference]
    peak = peak_flops()
    print(f"{args.steps} steps, median of steps > {args.warmup}, seq {args.seq_len}; peak "
          f"{peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")  # fmt: skip
    header = f"{'row':>22} {'side':>9} {'tok/s':>9} {'MFU %':>6} {'reserved GiB':>12} {'loss':>7} {'wall s':>7}"
    print(header, flush=True)
    results = {}
    for row in args.rows:
        flavor, _ = settings(row)
        for side in sides:
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                try:
                    run = run_ours if side == "ours" else run_reference
                    r = run(args, row, Path(tmp))
                except RuntimeError as e:
                    print(f"{row:>22} {side:>9} FAILED: {str(e)[:3000]}", flush=True)
                    results[f"{row} {side}"] = {"error": str(e)[-3000:]}
                    if args.json:
                        args.json.write_text(json.dumps(results, indent=1))
                    continue
                finally:
                    _keep_logs(args.logs, row, side, Path(tmp))
            r["wall_s"] = time.perf_counter() - start
            tps = statistics.median(r["tps"][args.warmup :] or r["tps"])
            mfu = 100 * tps * flops_per_token(flavor, args.seq_len) / peak if peak else float("nan")
            r |= {"median_tps": tps, "mfu_pct": mfu}
            results[f"{row} {side}"] = r
            print(
                f"{row:>22} {side:>9} {tps:>9,.0f} {mfu:>6.1f} {r['reserved_gib']:>12.2f} "
                f"{r['loss'][-1]:>7.3f} {r['wall_s']:>7.0f}",
                flush=True,
            )
            if args.json:  # after every row: a run cut short keeps what it measured
                args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""What the framework costs: ``run_train.sh`` against a bare PyTorch loop of the same work.

    python benchmarks/bench_overhead.py                            # 1 process, 4 x 512, fp32
    python benchmarks/bench_overhead.py --batch 8 --seq_len 2048 --dtype bfloat16 --steps 12

The bare loop is the least a user could write for the same step: the same Llama 3 debug model
and initial weights, the same batches of the bundled corpus, bf16 autocast when asked, the
summed cross-entropy over the global token count, gradient-norm clipping, fused AdamW with the
same hyper-parameters and a constant learning rate, nothing else (no metrics, logging,
watchdog, GC control, checkpoint polling). Both run in their own process, alternately
``--reps`` times (run-to-run noise on this machine is several percent); printed: each rep's
median tokens/s of the steps after warm-up, and the overhead as the median of the reps'
ratios. ``--profile DIR`` then traces one step of each side and prints the operators whose
exclusive time differs most, with the host time outside any operator (``(python/idle)``).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bare_loop(args: argparse.Namespace) -> list[float]:
    """Tokens/s of each step of the bare loop (run in this process)."""
    import torch

    from torchtitan.components.dataloader import build_dataloader
    from torchtitan.components.tokenizer import build_tokenizer
    from torchtitan.models.llama3 import model_spec
    from torchtitan.tools.paths import resolve_path

    torch.manual_seed(0)
    model_args = model_spec.args_for("debugmodel", seq_len=args.seq_len)
    with torch.device("meta"):
        model = model_spec.build_model(model_args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )
    tokenizer = build_tokenizer(resolve_path("tests/assets/tokenizer"))
    loader = build_dataloader(
        dataset="python_docs",
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=args.seq_len,
        local_batch_size=args.batch,
        dp_rank=0,
        dp_world_size=1,
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    tps = []
    batches = iter(loader)
    profiler = None
    if args.trace:  # the same step as run_train.sh's profiler records (see framework())
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            schedule=torch.profiler.schedule(wait=args.warmup - 1, warmup=1, active=1, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(Path(args.profile) / "bare.json")),
            record_shapes=True,
        )
        profiler.__enter__()
    for _ in range(args.steps):
        start = time.perf_counter()
        inputs, labels = next(batches)
        with autocast:
            logits = model(inputs["input"])
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
                )
                / labels.numel()
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        tps.append(labels.numel() / (time.perf_counter() - start))
        if profiler is not None:
            profiler.step()
    if profiler is not None:
        profiler.__exit__(None, None, None)
    return tps


def framework(args: argparse.Namespace, trace: bool = False) -> list[float]:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [
            "./run_train.sh",
            "--training.steps", str(args.steps),
            "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch),
            "--training.mixed_precision_param", args.dtype,
            "--lr_scheduler.warmup_steps", "0",
            "--lr_scheduler.decay_type", "constant",
            "--metrics.log_freq", str(args.log_freq),
            "--checkpoint.no_enable",
            "--debug.seed", "0",
            "--job.dump_folder", dump,
        ]  # fmt: skip
        if trace:  # record step `warmup + 1` (profile_freq counts from step 1)
            cmd += [
                "--profiling.enable_profiling",
                "--profiling.profile_freq", str(args.warmup + 1),
                "--profiling.profiler_warmup", "1",
                "--profiling.profiler_active", "1",
            ]  # fmt: skip
        env = os.environ | {"NGPU": "1", "PYTHON": sys.executable}
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
        if trace:
            trace_file = (
                Path(dump) / "profile_traces" / f"iteration_{args.warmup + 1}" / "rank0_trace.json"
            )
            shutil.copy(trace_file, Path(args.profile) / "ours.json")
        records = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    # A record covers the steps since the previous one: keep those wholly after warm-up.
    return [r["tps"] for r in records if r["step"] - args.log_freq >= args.warmup]


def self_times(path: Path) -> tuple[float, dict[str, float]]:
    """The recorded step's wall time and each operator's exclusive time in a Chrome trace
    (ms, summed over threads); time of the step's thread not inside any operator is
    ``(python/idle)``: interpreter work and waiting."""
    events = json.loads(path.read_text())["traceEvents"]
    step = next(e for e in events if e.get("name", "").startswith("ProfilerStep#"))
    lo, hi = step["ts"], step["ts"] + step["dur"]
    threads: dict[object, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and lo <= e["ts"] < hi:
            threads.setdefault(e["tid"], []).append(e)
    out: dict[str, float] = {}
    top_level = 0.0
    for tid, ops in threads.items():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in ops:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                out[stack[-1]["name"]] -= e["dur"]  # a child's time is not its parent's own
            elif tid == step["tid"]:
                top_level += e["dur"]
            out[e["name"]] = out.get(e["name"], 0.0) + e["dur"]
            stack.append(e)
    out["(python/idle)"] = step["dur"] - top_level
    return step["dur"] / 1e3, {k: v / 1e3 for k, v in out.items()}


def print_operators(first: tuple[str, dict], second: tuple[str, dict], n: int = 20) -> None:
    """The ``n`` operators whose exclusive ms differ most between two ``self_times``."""
    (a_name, a), (b_name, b) = first, second
    names = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))
    print(f"{'operator (exclusive ms)':<48}{a_name:>10}{b_name:>10}{'diff':>10}")
    for name in names[:n]:
        x, y = a.get(name, 0.0), b.get(name, 0.0)
        print(f"{name[:47]:<48}{x:>10.1f}{y:>10.1f}{y - x:>+10.1f}")


def compare_profiles(folder: Path) -> None:
    """Print the recorded step of both sides and the operators whose time differs most."""
    bare_wall, bare = self_times(folder / "bare.json")
    ours_wall, ours = self_times(folder / "ours.json")
    print(f"profiled step: bare loop {bare_wall:,.1f} ms, run_train.sh {ours_wall:,.1f} ms")
    print_operators(("bare", bare), ("ours", ours))
    print(f"traces: {folder}/bare.json, {folder}/ours.json (Perfetto or chrome://tracing)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument(
        "--log_freq", type=int, default=1, help="run_train.sh logs (and syncs) every N steps"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="then trace step warmup+1 of one more run of each side into DIR and compare",
    )
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:  # the bare loop, in a process of its own
        print(json.dumps(bare_loop(args)))
        return
    bare_cmd = [sys.executable, __file__, "--bare", *sys.argv[1:]]
    bare, ours = [], []
    for rep in range(args.reps):  # alternate, so drifts of the machine hit both alike
        out = subprocess.run(bare_cmd, cwd=REPO, check=True, capture_output=True, text=True)
        bare.append(statistics.median(json.loads(out.stdout.splitlines()[-1])[args.warmup :]))
        ours.append(statistics.median(framework(args)))
        print(f"rep {rep + 1}: bare loop {bare[-1]:,.0f} tok/s, run_train.sh {ours[-1]:,.0f}")
    if args.profile:  # one more run of each, traced, kept out of the figures above
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        subprocess.run([*bare_cmd, "--trace"], cwd=REPO, check=True, capture_output=True)
        framework(args, trace=True)
        compare_profiles(Path(args.profile))
    # Kernel speed differs from process to process by a few percent (same ops, same shapes):
    # pair each rep's two runs and take the median of the ratios.
    overhead = statistics.median(b / o - 1 for b, o in zip(bare, ours, strict=True))
    print(
        f"{args.batch} x {args.seq_len}, {args.dtype}, 1 process, median of steps "
        f"{args.warmup + 1}-{args.steps}, {args.reps} reps: bare loop "
        f"{statistics.median(bare):,.0f} tok/s, run_train.sh {statistics.median(ours):,.0f} "
        f"tok/s (logging every {args.log_freq} steps); framework overhead (median of the reps' "
        f"ratios) {100 * overhead:+.1f}%"
    )


if __name__ == "__main__":
    main()

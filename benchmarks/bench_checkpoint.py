"""Checkpoint cost on this machine: save (sync and async), the steps async saves overlap,
the background write, size on disk and load time, for the debug model and a ~100M flavor.

    python benchmarks/bench_checkpoint.py
    python benchmarks/bench_checkpoint.py --flavors debugmodel --saves 5

One process. For async saves, per save:
  blocking   the time ``save()`` holds the training loop (copying the state to host memory);
  step/norm  the step that follows the save (it includes the blocking copy, and trains while
             the write runs) over the median step of the run;
  write      how long the background write took.
The first save allocates the host buffers that later saves reuse, so it is shown apart. The
save interval is chosen so that a write ends before the next save starts (a save that finds
the previous write unfinished waits for it, and the trainer warns).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from torchtitan.config.manager import parse_args
from torchtitan.tools.logging import init_logger
from torchtitan.trainer import Trainer

# Steps between saves: longer than one background write on a 2-core CPU host.
INTERVALS = {"debugmodel": 12, "debug_100m": 40}
# (local batch, sequence length): the debug model's own training shape; 4 x 128 keeps the
# ~100M flavor's step near 3 s on two cores.
SHAPES = {"debugmodel": (8, 512), "debug_100m": (4, 128)}
SHAPE: tuple[int, int] | None = None  # --shape


def _trainer(dump: str, flavor: str, *flags: str) -> Trainer:
    batch, seq_len = SHAPE or SHAPES.get(flavor, (4, 128))
    args = [
        "--model.flavor", flavor, "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(batch),
        "--metrics.log_freq", "1", "--metrics.no_enable_color_printing", "--debug.seed", "0",
        "--checkpoint.enable", "--checkpoint.no_last_save_model_only", "--job.dump_folder", dump,
        *flags,
    ]  # fmt: skip
    return Trainer(parse_args(args, console_outputs=False))


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir()) / 1e6


def measure_sync(flavor: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as dump:
        trainer = _trainer(dump, flavor, "--training.steps", "2", "--checkpoint.interval", "1000")
        trainer.train()
        start = time.perf_counter()
        trainer.checkpointer.save(1000)
        sync = time.perf_counter() - start
        size = _size_mb(Path(dump) / "checkpoint/step-1000")
        trainer.close()

        loader = _trainer(dump, flavor, "--training.steps", "2000", "--checkpoint.load_only")
        start = time.perf_counter()
        loader.checkpointer.load()
        load = time.perf_counter() - start
        loader.close()
    return {"sync save s": sync, "size MB": size, "load s": load}


def measure_async(flavor: str, saves: int, interval: int) -> list[dict[str, float]]:
    steps = interval * (saves + 1)
    per_save: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as dump:
        trainer = _trainer(
            dump, flavor, "--training.steps", str(steps), "--checkpoint.interval", str(interval),
            "--checkpoint.async_mode", "async",
        )  # fmt: skip
        checkpointer = trainer.checkpointer
        save = checkpointer.save

        def timed_save(step, **kwargs):
            start = time.perf_counter()
            save(step, **kwargs)
            if kwargs.get("last"):
                return
            done = time.perf_counter()
            figures = per_save[step] = {"blocking s": done - start}

            def written(_, figures=figures, done=done):
                figures["write s"] = time.perf_counter() - done

            checkpointer.background.pending.future.add_done_callback(written)

        checkpointer.save = timed_save
        records = []
        log = trainer.metrics.log
        trainer.metrics.log = lambda step, **kw: records.append(log(step, **kw)) or records[-1]
        trainer.train()
        trainer.close()
    step_times = {r["step"]: r["step_time_s"] for r in records}
    normal = statistics.median(
        t for s, t in step_times.items() if s > 2 and s - 1 not in per_save and s != steps
    )
    for step, figures in per_save.items():
        figures["step/norm"] = step_times[step + 1] / normal
    return [per_save[s] for s in sorted(per_save)]


def _fmt(figures: dict[str, float]) -> str:
    return "  ".join(f"{k}: {v:.3f}" for k, v in figures.items())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flavors", nargs="+", default=["debugmodel", "debug_100m"])
    parser.add_argument("--saves", type=int, default=3, help="async saves per flavor")
    parser.add_argument("--interval", type=int, default=0, help="steps between saves")
    parser.add_argument(
        "--shape", help="local batch x sequence length for every flavor, e.g. 4x128"
    )
    args = parser.parse_args()
    if args.shape:
        global SHAPE
        batch, seq_len = args.shape.split("x")
        SHAPE = (int(batch), int(seq_len))
    init_logger()
    import logging

    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    for flavor in args.flavors:
        batch, seq_len = SHAPE or SHAPES.get(flavor, (4, 128))
        print(f"{flavor} ({batch} x {seq_len} tokens)", _fmt(measure_sync(flavor)), flush=True)
        interval = args.interval or INTERVALS.get(flavor, 16)
        results = measure_async(flavor, args.saves, interval)
        print(f"  async, save every {interval} steps", flush=True)
        print("    first save:", _fmt(results[0]), flush=True)
        for key in ("blocking s", "step/norm", "write s"):
            later = [r[key] for r in results[1:] if key in r]
            if later:
                print(f"    later saves {key}: {', '.join(f'{v:.3f}' for v in later)}")


if __name__ == "__main__":
    main()

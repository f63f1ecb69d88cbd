"""Checkpoint cost on this machine: save (sync and async), the step an async save overlaps,
size on disk and load time, for the debug model and a ~100M-parameter flavor.

    python benchmarks/bench_checkpoint.py
    python benchmarks/bench_checkpoint.py --flavors debugmodel --steps 12

One process. "async blocking" is the time ``save()`` holds the training loop (staging a copy
of the state); the write continues in the background. "step with async save / normal" compares
the step after an async save started (it trains while the write runs) with the median step.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from torchtitan.config.manager import parse_args
from torchtitan.tools.logging import init_logger
from torchtitan.train import Trainer


def _trainer(dump: str, flavor: str, *flags: str) -> Trainer:
    args = [
        "--model.flavor", flavor, "--training.seq_len", "128", "--training.local_batch_size", "4",
        "--metrics.log_freq", "1", "--metrics.no_enable_color_printing", "--debug.seed", "0",
        "--checkpoint.enable", "--checkpoint.no_last_save_model_only", "--job.dump_folder", dump,
        *flags,
    ]  # fmt: skip
    return Trainer(parse_args(args, console_outputs=False))


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir()) / 1e6


def measure(flavor: str, steps: int) -> dict[str, float]:
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

    with tempfile.TemporaryDirectory() as dump:
        half = steps // 2
        trainer = _trainer(
            dump, flavor, "--training.steps", str(steps), "--checkpoint.interval", str(half),
            "--checkpoint.async_mode", "async",
        )  # fmt: skip
        save = trainer.checkpointer.save
        blocking: list[float] = []

        def timed_save(step, **kwargs):
            start = time.perf_counter()
            save(step, **kwargs)
            if step == half:
                blocking.append(time.perf_counter() - start)

        trainer.checkpointer.save = timed_save
        records = []
        log = trainer.metrics.log
        trainer.metrics.log = lambda step, **kw: records.append(log(step, **kw)) or records[-1]
        trainer.train()
        trainer.close()
    step_times = {r["step"]: r["step_time_s"] for r in records}
    normal = statistics.median(
        t for s, t in step_times.items() if s > 2 and s not in (half + 1, steps)
    )
    return {
        "sync save s": sync,
        "async blocking s": blocking[0],
        "step with async save / normal": step_times[half + 1] / normal,
        "size MB": size,
        "load s": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flavors", nargs="+", default=["debugmodel", "debug_100m"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    init_logger()
    import logging

    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    for flavor in args.flavors:
        figures = measure(flavor, args.steps)
        print(flavor, "  ".join(f"{k}: {v:.3f}" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()

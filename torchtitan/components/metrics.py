"""Training metrics: throughput, FLOPs, memory, and where they go (console, TensorBoard,
W&B, and a JSON-lines file in the dump folder)."""

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Metrics as MetricsConfig
from torchtitan.tools.device import MemoryMonitor, peak_flops
from torchtitan.tools.logging import logger


class Color:
    red = "\033[31m"
    green = "\033[32m"
    yellow = "\033[33m"
    blue = "\033[34m"
    magenta = "\033[35m"
    cyan = "\033[36m"
    reset = "\033[39m"


class NoColor:
    red = green = yellow = blue = magenta = cyan = reset = ""


class MetricsProcessor:
    """Accumulates per-step counters and turns them into one record every ``log_freq`` steps.

    ``tps`` is tokens per second per device; ``tflops`` and ``mfu`` use
    ``flops_per_token`` (6N + attention); ``mfu`` is left out when the peak is unknown.
    """

    def __init__(
        self,
        config: MetricsConfig,
        *,
        dump_folder: str,
        device: torch.device,
        flops_per_token: int,
        rank: int,
        save_rank: bool,
        run_config: dict[str, Any] | None = None,
    ):
        self.config = config
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops(device, config.peak_flops)
        self.memory = MemoryMonitor(device)
        self.color = Color if config.enable_color_printing and _terminal() else NoColor
        self.rank = rank
        self._tokens = 0
        self._data_seconds = 0.0
        self._steps = 0
        self._last_log = time.perf_counter()
        self._run: tuple[int, int, float] | None = None  # first step, last step, start time
        self._work: Callable[[int], int] = lambda step: step
        self._sinks: list[_Sink] = []
        if save_rank:
            suffix = "" if rank == 0 and not config.save_for_all_ranks else f"_rank{rank}"
            self._sinks.append(_JsonlSink(Path(dump_folder) / f"metrics{suffix}.jsonl"))
            if config.enable_tensorboard:
                folder = Path(dump_folder) / config.save_tb_folder
                if config.save_for_all_ranks:
                    folder = folder / f"rank_{rank}"
                self._sinks.append(_TensorBoardSink(folder))
            if config.enable_wandb:
                self._sinks.append(_WandbSink(dump_folder, rank, run_config or {}))
        if self.peak_flops is None:
            logger.info("Peak FLOP/s of this device unknown: MFU is not reported")

    def start_run(
        self, *, first_step: int, last_step: int, work: Callable[[int], int] | None = None
    ) -> None:
        """Steps ``first_step + 1 .. last_step`` follow: the console shows progress and ETA.
        ``work(step)``: the work of steps 1 .. ``step`` (accumulation batches, which a batch
        ramp makes unequal per step); default one unit per step."""
        self._run = (first_step, last_step, time.perf_counter())
        self._work = work if work is not None else (lambda step: step)

    def _eta_seconds(self, step: int) -> float | None:
        if self._run is None or step <= self._run[0]:
            return None
        first, last, start = self._run
        done = self._work(step) - self._work(first)
        left = max(self._work(last) - self._work(step), 0)
        return (time.perf_counter() - start) / max(done, 1) * left

    def should_log(self, step: int, last_step: int) -> bool:
        return step == 1 or step % self.config.log_freq == 0 or step == last_step

    def record_step(self, *, tokens: int, data_seconds: float) -> None:
        """Count one optimizer step's local tokens and the time spent waiting for data."""
        self._tokens += tokens
        self._data_seconds += data_seconds
        self._steps += 1

    def exclude_seconds(self, seconds: float) -> None:
        """Leave ``seconds`` of work that is not training (a validation) out of the next
        record's throughput and step time."""
        self._last_log += seconds

    def log(
        self,
        step: int,
        *,
        loss: float,
        loss_max: float,
        grad_norm: float,
        lr: float,
        extra: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """Emit one record covering the steps since the previous call; return it."""
        now = time.perf_counter()
        elapsed = max(now - self._last_log, 1e-9)
        tps = self._tokens / elapsed
        tflops = self.flops_per_token * tps / 1e12
        mem = self.memory.stats()
        record: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "loss_max": loss_max,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "tflops": tflops,
            "step_time_s": elapsed / max(self._steps, 1),
            "data_loading_pct": 100 * self._data_seconds / elapsed,
            "memory_peak_gib": mem.peak_active_gib,
        }
        if self.peak_flops is not None:
            record["mfu_pct"] = 100 * tflops * 1e12 / self.peak_flops
        if mem.peak_reserved_gib is not None:
            record |= {
                "memory_peak_active_pct": mem.peak_active_pct,
                "memory_peak_reserved_gib": mem.peak_reserved_gib,
                "memory_peak_reserved_pct": mem.peak_reserved_pct,
                "memory_alloc_retries": mem.alloc_retries,
                "memory_ooms": mem.ooms,
            }
        eta = self._eta_seconds(step)
        if eta is not None:
            record["eta_s"] = eta
        record |= extra or {}
        self._console(record, mem.summary())
        for sink in self._sinks:
            sink.write(record)
        self._tokens, self._data_seconds, self._steps = 0, 0.0, 0
        self._last_log = time.perf_counter()
        self.memory.reset_peak()
        return record

    def _console(self, r: dict[str, Any], memory: str) -> None:
        c = self.color
        progress = f"{r['step']:2}"
        if self._run is not None:
            last = self._run[1]
            width = max(2, len(str(last)))
            progress = f"{r['step']:{width}}/{last} ({100 * r['step'] / last:.0f}%)"
        line = (
            f"{c.red}step: {progress}  "
            f"{c.green}loss: {r['loss']:7.4f}  "
            f"{c.cyan}grad_norm: {r['grad_norm']:7.4f}  "
            f"{c.yellow}memory: {memory}  "
            f"{c.blue}tps: {round(r['tps']):,}  "
            f"{c.cyan}tflops: {r['tflops']:,.2f}  "
        )
        if "mfu_pct" in r:
            line += f"{c.magenta}mfu: {r['mfu_pct']:.2f}%  "
        line += f"{c.reset}lr: {r['lr']:.3e}  data: {r['data_loading_pct']:.1f}%"
        if "moe_load_max_over_mean" in r:  # busiest expert's load / mean, averaged over layers
            line += f"  moe load: {r['moe_load_max_over_mean']:.2f}"
        if "pp_idle_pct" in r:
            line += f"  bubble: {r['pp_idle_pct']:.0f}%"
            if "pp_bubble_ideal_pct" in r:
                line += f" (ideal {r['pp_bubble_ideal_pct']:.0f}%)"
        if "global_batch_size" in r:  # under a batch ramp
            line += f"  batch: {r['global_batch_size']}"
        if "eta_s" in r and r["eta_s"] > 0:
            line += f"  eta: {_duration(r['eta_s'])}"
        logger.info(line)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


class _Sink:
    def write(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _JsonlSink(_Sink):
    """One JSON object per logged step; line-buffered so a crash loses nothing logged."""

    def __init__(self, path: Path):
        self._path = path
        self._file = None  # opened at the first record: a new run sets the last one aside first

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._path.open("a", buffering=1)
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class _TensorBoardSink(_Sink):
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(folder / time.strftime("%Y%m%d-%H%M%S")))
        logger.info(f"TensorBoard logs in {folder}")

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key != "step":
                self._writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._writer.close()


class _WandbSink(_Sink):
    def __init__(self, dump_folder: str, rank: int, run_config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "--metrics.enable_wandb needs wandb: pip install 'torchtitan[wandb]'"
            ) from None
        self._wandb = wandb
        os.environ.setdefault("WANDB_DIR", dump_folder)
        try:
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "torchtitan"),
                dir=dump_folder,
                name=os.environ.get("WANDB_RUN_NAME"),
                group=os.environ.get("WANDB_RUN_GROUP"),
                config=run_config | {"rank": rank},  # the resolved config, to compare runs by
            )
        except wandb.errors.Error as e:  # no API key, no network, a bad entity or project
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"--metrics.enable_wandb: W&B could not start a run ({reason}); run `wandb "
                "login` or set WANDB_API_KEY, or log without an account with WANDB_MODE=offline "
                f"(the run's files go to {dump_folder}/wandb)"
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self._run.finish()
        # wandb flushes and stops its service in an atexit hook, which the trainer's os._exit
        # skips: without this the offline run file can be left without its last records.
        self._wandb.teardown()


def _terminal() -> bool:
    """Whether the console is a terminal (colour codes in a file or a pipe are noise). Under
    the launcher a rank writes into torchrun's pipe: the launcher says whether its own
    console is one (``TITAN_TERMINAL``)."""
    told = os.environ.get("TITAN_TERMINAL")
    return told == "1" if told is not None else sys.stderr.isatty()


def _duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"

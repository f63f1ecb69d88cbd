"""The ``torchtitan`` logger: one format, rank-tagged, on every rank (run_train.sh filters)."""

import logging
import os
import sys
import time
import warnings
from pathlib import Path

logger = logging.getLogger("torchtitan")


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (it may be redirected after setup)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def init_logger() -> None:
    """Log INFO and above to stderr with the rank in each line."""
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if logger.handlers:
        return
    # Under the launcher torchrun prefixes every line with the rank already ("[rank0]:").
    prefix = (
        " " if os.environ.get("TITAN_LAUNCHER") else f"[titan rank{os.environ.get('RANK', '0')}] "
    )
    handler = _CurrentStderrHandler()
    handler.setFormatter(
        logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)


def log_to_file(dump_folder: str) -> Path | None:
    """Also write this rank's log lines to ``<dump_folder>/logs/<run>/rank<r>.log`` (``<run>``:
    the launcher's start time, the same for every rank of a run); return the file, or
    ``None`` when the folder cannot be made (the console still has everything)."""
    run = os.environ.get("TITAN_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    path = Path(dump_folder) / "logs" / run / f"rank{os.environ.get('RANK', '0')}.log"
    for old in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
        logger.removeHandler(old)  # a previous run in this process
        old.close()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError:
        return None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    return path


class _DropMessages(logging.Filter):
    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # arguments that do not fit the format: logging reports that itself
            message = str(record.msg)
        return not message.startswith(self.starts)


def quiet_known_torch_notices(*, cuda: bool) -> None:
    """Torch notices that mean nothing to a user of a normal run (each checked to be benign
    here): DTensor's random-op support note on CPU meshes (our CPU init does not use DTensor
    random ops); the note on two sequential all-reduces when the gradient norm is reduced
    over FSDP x TP (the norm is layout-invariant: tests/integration_tests/test_loss_compare.py);
    inductor's note that it leaves complex operators to eager (RoPE's rotation, a few
    elementwise ops per block; compiled blocks still equal eager ones in the numerics tests);
    the profiler's note that it clears its events each cycle (each cycle's trace is written);
    torch 2.13's pipeline-stage note that a stage's output has no gradient given, which only the
    last stage's can be (``pipeline_parallel.build_stages`` gives every other stage's; the
    loss is computed on the last, and torch calls it legal there: seen under TP's DTensor
    logits);
    torch 2.13's deprecation note on torchao registering its enums as pytree constants (seen
    where ``transformers`` or ``peft`` import torchao's quantization); and, without CUDA,
    torchao's failure to load its CUDA kernels (mxfp8, CUTLASS), which float8 training does
    not use."""
    warnings.filterwarnings(
        "ignore", message="DTensor random operators may not have complete support"
    )
    warnings.filterwarnings(
        "ignore", message="Torchinductor does not support code generation for complex operators"
    )
    warnings.filterwarnings(
        "ignore", message=r"Stage \d+: output_args\[0\] has requires_grad=True, but output_grads"
    )
    # The profiler's trace is written at the end of each cycle, so clearing it then is right.
    warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end")
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
        _DropMessages("While redistributing from")
    )
    logging.getLogger("torch.utils._pytree").addFilter(_DropMessages("<enum "))
    if not cuda:
        logging.getLogger("torchao").addFilter(_DropMessages("Failed to load"))


def log_to_files_only(level: int, message: str) -> None:
    """A line for the log files and not the console (which shows it another way)."""
    record = logger.makeRecord(logger.name, level, __file__, 0, message, None, None)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)

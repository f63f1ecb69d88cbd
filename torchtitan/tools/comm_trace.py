"""``--debug.comm_trace_step N``: which collectives each module issues, traced for one step.

The step runs under ``torch.distributed.tensor.debug.CommDebugMode``; afterwards every rank
writes to ``<dump>/comm_trace/``:

- ``rank<r>_step<N>.txt``: the per-module table at ``--debug.comm_trace_noise_level``,
- ``rank<r>_step<N>.json``: the same trace as JSON,

and the logging rank prints the module-level table (noise level 0) to the console.
"""

import contextlib
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

from torchtitan.config.job_config import Debug
from torchtitan.tools.logging import logger


@contextlib.contextmanager
def maybe_trace_collectives(
    step: int, config: Debug, *, dump_folder: str, rank: int
) -> Iterator[None]:
    """Trace the collectives inside when ``step == config.comm_trace_step``; else nothing."""
    if step != config.comm_trace_step:
        yield
        return
    # Imported here: torch.distributed.tensor.debug loads dynamo, half a second of a start.
    from torch.distributed.tensor.debug import CommDebugMode

    noise_level = config.comm_trace_noise_level
    mode = CommDebugMode()
    with warnings.catch_warnings():
        # What the tracer's module hooks make torch say (the traced step is otherwise the same
        # step: its collectives are the untraced step's, tests/integration_tests/test_debugging).
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with mode:
            yield
    folder = Path(dump_folder) / "comm_trace"
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"rank{rank}_step{step}"
    Path(f"{stem}.txt").write_text(_plain(mode.generate_comm_debug_tracing_table(noise_level)))
    mode.generate_json_dump(file_name=f"{stem}.json", noise_level=noise_level)
    counts = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
    logger.info(
        f"Collectives of step {step} ({mode.get_total_counts()} in all: {counts}), per module; "
        f"details in {stem}.txt / .json\n{_plain(mode.generate_comm_debug_tracing_table(0))}"
    )


def _plain(table: str) -> str:
    """The table without its terminal colours (they end up in files and log files)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", table)

"""The ``torchtitan`` logger: one format, rank-tagged, on every rank (run_train.sh filters)."""

import logging
import os
import sys

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

"""The ``torchtitan`` logger: one format, rank-tagged, on every rank (run_train.sh filters)."""

import logging
import os

logger = logging.getLogger("torchtitan")


def init_logger() -> None:
    """Log INFO and above to stderr with the rank in each line."""
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if logger.handlers:
        return
    rank = os.environ.get("RANK", "0")
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"[titan rank{rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)

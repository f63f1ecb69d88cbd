"""A trainer whose rank ``REFUSE_RANK`` alone refuses its input while building (the others go
on and wait for it in a collective), ``REFUSE_AFTER_S`` seconds late (0 by default): tests
that the launcher shows that rank's line, and only it.

Launched with ``python -m torchtitan.launcher`` like ``torchtitan.train``; the remaining
arguments are trainer flags.
"""

import os
import time

from launch import run_trainer_and_exit

from torchtitan import trainer
from torchtitan.config.errors import ConfigError

REFUSE_RANK = int(os.environ["REFUSE_RANK"])
REFUSE_AFTER_S = float(os.environ.get("REFUSE_AFTER_S", "0"))
_build_data = trainer.Trainer.build_data


def build_data(self):
    if self.rank == REFUSE_RANK:
        time.sleep(REFUSE_AFTER_S)
        raise ConfigError(f"only rank {REFUSE_RANK} refuses this input")
    return _build_data(self)


if __name__ == "__main__":
    trainer.Trainer.build_data = build_data
    run_trainer_and_exit()

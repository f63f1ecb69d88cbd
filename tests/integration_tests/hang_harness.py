"""A trainer whose rank ``HANG_RANK`` sleeps inside step ``HANG_STEP``: tests the watchdog.
With ``HANG_ONCE=1`` only the first attempt hangs (a restarted one trains on).

Launched with torchrun like ``torchtitan.train``; the remaining arguments are trainer flags.
"""

import os
import time

from launch import run_trainer_and_exit

from torchtitan import trainer

HANG_RANK = int(os.environ["HANG_RANK"])
HANG_STEP = int(os.environ["HANG_STEP"])
_train_step = trainer.Trainer.train_step


def train_step(self, batches):
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    once = os.environ.get("HANG_ONCE") == "1"
    if self.rank == HANG_RANK and self.step == HANG_STEP and (first_attempt or not once):
        time.sleep(600)
    return _train_step(self, batches)


if __name__ == "__main__":
    trainer.Trainer.train_step = train_step
    run_trainer_and_exit()

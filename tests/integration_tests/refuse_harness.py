"""A trainer whose rank ``REFUSE_RANK`` alone (or, with ``REFUSE_ON_THIS_NODE=1``, the ranks
of the launcher given it) refuses its input while building (the others go on and wait for it
in a collective), ``REFUSE_AFTER_S`` seconds late (0 by default): tests that the launcher
shows that rank's line, and only it. With ``REFUSE_BY_CRASHING=1`` it raises a ``ValueError``
instead, an exception the trainer does not expect; with ``REFUSE_BY_DYING=1`` it kills itself
(SIGKILL: no record of its own, as the kernel's out-of-memory killer leaves). ``READ_REFUSAL_AFTER_S`` delays the other
ranks' look into the job's store for a refusal or a crash, as a loaded node would. With
``HANG_UNLESS_REFUSING=1`` the other ranks never notice: they wait without end, SIGTERM only
noted (a line says so), as ranks wait in an NCCL collective for one that is gone (with the
trainer's preemption handler installed).

Launched with ``python -m torchtitan.launcher`` like ``torchtitan.train``; the remaining
arguments are trainer flags.
"""

import os
import signal
import time

from launch import run_trainer_and_exit

from torchtitan import job_store, trainer
from torchtitan.config.errors import ConfigError

REFUSE_RANK = int(os.environ.get("REFUSE_RANK", "-1"))
ON_THIS_NODE = os.environ.get("REFUSE_ON_THIS_NODE") == "1"
REFUSE_AFTER_S = float(os.environ.get("REFUSE_AFTER_S", "0"))
READ_REFUSAL_AFTER_S = float(os.environ.get("READ_REFUSAL_AFTER_S", "0"))
CRASH = os.environ.get("REFUSE_BY_CRASHING") == "1"
DIE = os.environ.get("REFUSE_BY_DYING") == "1"
HANG = os.environ.get("HANG_UNLESS_REFUSING") == "1"
_published = job_store.published
_build_data = trainer.Trainer.build_data


def build_data(self):
    if self.rank == REFUSE_RANK or ON_THIS_NODE:
        time.sleep(REFUSE_AFTER_S)
        if DIE:
            os.kill(os.getpid(), signal.SIGKILL)
        if CRASH:
            raise ValueError(f"rank {self.rank} crashed while building its data")
        raise ConfigError(f"only rank {self.rank} refuses this input")
    if HANG:
        signal.signal(signal.SIGTERM, lambda signum, frame: print("SIGTERM noted", flush=True))
        agent = os.getppid()
        while os.getppid() == agent:  # not past its launcher (a test that gave up killed it)
            time.sleep(1)
        os._exit(1)
    return _build_data(self)


def published():
    time.sleep(READ_REFUSAL_AFTER_S)
    return _published()


if __name__ == "__main__":
    trainer.Trainer.build_data = build_data
    job_store.published = published
    run_trainer_and_exit()

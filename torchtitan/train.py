"""Entry point: ``python -m torchtitan.train --module llama3 --config llama3_debugmodel [flags]``.

Parses the config, checks what needs torch, chooses the run (train | seed checkpoint |
validation only | dry run) and maps its outcome to an exit code: 0 done, 2 bad input (one
line, no traceback per rank), 3 a non-finite step, 4 another rank went away mid-collective
(one line: the launcher reports that rank's failure as the cause), 75 preempted with a
checkpoint saved (``components/preemption.py``). Any other exception propagates with its
traceback, which the rank's log file also keeps; under the launcher it is recorded for it
(``failure_records.note_crash``: the launcher names it first) and this rank exits 1 after
printing the traceback.
Launch several ranks with ``./run_train.sh``. The ``Trainer`` itself is in
``torchtitan.trainer``; nothing imports this module.
"""

import copy
import json
import logging
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence

import torch

from torchtitan import dry_run, failure_records, generate
from torchtitan.components import preemption, run_lock
from torchtitan.components.preemption import Preempted
from torchtitan.components.train_state import NonFiniteError
from torchtitan.config import JobConfig, folders
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import named_config, parse_args
from torchtitan.config.validation import ignored_settings, validate_environment
from torchtitan.distributed import local_tensor
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import (
    init_logger,
    log_to_file,
    log_to_files_only,
    logger,
    quiet_known_torch_notices,
)
from torchtitan.trainer import Trainer


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run, shut down; return the exit code."""
    init_logger()
    log_file, config, locks = None, None, []
    try:
        config = parse_args(argv)
        quiet_known_torch_notices(cuda=dist_utils.device_type() == "cuda")
        log_file = log_to_file(config.job.dump_folder)
        validate_environment(config, dist_utils.device_type())
        locks = _lock(config)
        for note in ignored_settings(config, named_config(argv)):
            logger.warning(note)
        if config.comm.mode == "local_tensor" and config.debug.seed is None:
            # Simulated pipeline ranks run in threads that cannot share a drawn seed.
            config.debug.seed = int(torch.randint(0, 2**31 - 1, ()))
        pp = config.parallelism.pipeline_parallel_degree
        # One config per simulated pipeline rank (threads), copied before any of them runs.
        configs = [config] + [copy.deepcopy(config) for _ in range(pp - 1)]
        preempted: list[Preempted] = []
        local_tensor.run(config.comm.mode, pp, lambda r: _run(configs[r], preempted.append))
        if preempted:
            # The launcher reports it and exits with EXIT_CODE; torchrun must see this rank
            # succeed, or it would restart the ranks in a job that is being stopped.
            p = preempted[0]
            under_launcher = failure_records.note_preempted(p.signal.name, p.step, p.checkpoint)
            return 0 if under_launcher else preemption.EXIT_CODE
        return 0
    except (ConfigError, FileNotFoundError) as e:
        return _stop(2, str(e))
    except NonFiniteError as e:
        return _stop(3, str(e))
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank of the terminal's process group at once: one line each,
        # not a traceback of wherever the step was.
        logger.warning(f"Interrupted (SIGINT, Ctrl-C): stopped without saving; {_resumes(config)}")
        return INTERRUPTED_EXIT_CODE
    except Exception as e:
        text = "".join(traceback.format_exception(e))
        log_to_files_only(logging.ERROR, text.rstrip())
        if (words := dist_utils.lost_peer(e)) is None:
            if not failure_records.note_crash(e, log_file):
                raise
            # The launcher names it as the cause, and shows this traceback where LOG_RANK hides
            # this rank's console: printed now, before this rank's process group goes and the
            # ranks that lose it end the job (torchrun may kill this process while it exits).
            # After torchrun's prefix with a space, as log lines are.
            sys.stderr.write("".join(f" {line}" for line in text.splitlines(True)))
            return CRASH_EXIT_CODE
        # A consequence, not a cause: the rank that died is the story, and torchrun reports
        # it. Thirty lines of this rank's stack inside a collective would bury it.
        where = f"; traceback in {log_file}" if log_file else ""
        line = f"Stopping: another rank went away during a collective ({words}){where}"
        if failure_records.a_rank_said_why():  # it went away after saying why: the launcher
            log_to_files_only(logging.ERROR, line)
        else:
            logger.error(line)
        return failure_records.LOST_PEER_EXIT_CODE
    finally:
        dist_utils.shutdown()
        for lock in locks:
            lock.release()


def _lock(config: JobConfig) -> list[run_lock.RunLock]:
    """The locks of the dump folder and of a checkpoint folder outside it, held by rank 0 of a
    run that writes there (not a dry run or a validation of saved weights, which may run
    beside the training that saves them)."""
    if os.environ.get("RANK", "0") != "0" or config.comm.mode == "fake_backend":
        return []
    if config.validation.only:
        return []
    locks: list[run_lock.RunLock] = []
    try:
        for flag, folder in folders.locked_folders(config):
            locks.append(run_lock.take(folder, flag=flag, warn=logger.warning))
    except ConfigError:
        for lock in locks:  # the folders taken before the one in use
            lock.release()
        raise
    return locks


INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports it
CRASH_EXIT_CODE = 1  # an unexpected exception, as Python's own exit reports it


def _resumes(config: JobConfig | None) -> str:
    if config is not None and config.comm.mode != "default":
        return f"COMM_MODE={config.comm.mode} saves nothing"
    if config is None or not config.checkpoint.enable:
        return "nothing was being saved (--checkpoint.enable is off)"
    return (
        "the same command resumes from the last complete checkpoint; SIGTERM or SIGUSR1 "
        "saves the current step first (docs/fault_tolerance.md)"
    )


def _stop(code: int, message: str) -> int:
    """One line for the user: through the launcher (which prints the first rank's) when there
    is one, else on this rank's console."""
    if failure_records.refuse(code, message):
        log_to_files_only(logging.ERROR, message)  # the launcher prints it on the console
    else:
        logger.error(message)
    return code


def _run(config: JobConfig, on_preempted: Callable[[Preempted], None]) -> None:
    """One job: a training run, a seed checkpoint, a validation only or a dry run."""
    trainer = None
    try:
        if config.comm.mode == "fake_backend":
            trainer = dry_run.build_trainer(config)
            dry_run.run(trainer)
        elif config.checkpoint.create_seed_checkpoint:
            trainer = Trainer(config)
            trainer.create_seed_checkpoint()
        elif config.validation.only:
            trainer = Trainer(config)
            _validate_only(trainer)
        else:
            trainer = Trainer(config)
            trainer.train()
            if trainer.preempted is not None:
                on_preempted(trainer.preempted)
            elif config.validation.sample_prompt:
                generate.print_sample(trainer, config.validation)
            trainer.close()
            if trainer.rank == 0 and config.metrics.report:
                _write_report(config.job.dump_folder)
    finally:
        if trainer is not None:
            trainer.close()


def _validate_only(trainer: Trainer) -> None:
    """``--validation.only``: one validation of the weights the trainer loaded, appended to
    ``<dump_folder>/validation_only.jsonl`` (a record per call, with what was validated)."""
    checkpointer = trainer.checkpointer
    loaded = checkpointer.loaded_from if checkpointer is not None else None
    source = loaded or trainer.config.checkpoint.initial_load_path
    if source is None:
        logger.warning("--validation.only: no checkpoint loaded, so the initial weights it is")
    result = trainer.validator.run(trainer.step)
    if trainer.rank == 0 and result:
        record = {"step": trainer.step, "weights": str(source or "initial")} | result
        path = os.path.join(trainer.config.job.dump_folder, "validation_only.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        logger.info(f"Validation of {record['weights']} appended to {path}")


def _write_report(dump_folder: str) -> None:
    """The run report (``torchtitan.tools.report``): its summary and where the plots are."""
    from torchtitan.tools import report

    try:
        png, summary = report.write_report(dump_folder)
    except Exception as e:  # the run itself is done and saved; a report is not worth failing it
        logger.warning(f"No run report: {type(e).__name__}: {e}")
        return
    logger.info(f"Run report{f': {png}' if png else ''}\n" + textwrap.indent(summary, "   "))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # torch's CPU build sometimes aborts at interpreter exit after a clean shutdown
    # ("terminate called without an active exception"); everything is flushed, so skip it.
    os._exit(code)

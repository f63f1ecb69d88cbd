"""The folders a run writes into, checked before it starts: none of them a file
(``path_checks``, in the one validation pass), each writable (``check_writable``, at launch
and on each node), and which of them a run locks (``locked_folders``). No torch."""

import contextlib
import os
import tempfile
from pathlib import Path

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig


def path_checks(config: JobConfig) -> list[tuple[bool, str]]:
    """Folders the run writes into, checked before anything starts (a folder that is a file
    would otherwise be found at the first save, after the training). Nothing is made here,
    and what this user may write is not judged (printing a config, or sampling, writes
    nothing): ``check_writable`` tries a write at launch (``validate_launch``) and on each
    node (``validate_environment``)."""
    dump = config.job.dump_folder
    checks = [
        (dump.strip() != "", "--job.dump_folder is empty; give a folder for logs and checkpoints")
    ]
    for flag, folder in output_folders(config):
        blocker = next((p for p in (folder, *folder.parents) if exists(p)), None)
        checks.append(
            (
                blocker is None or blocker.is_dir(),
                f"{flag}: {blocker} is a file, not a folder; choose another path",
            )
        )
    return checks


def output_folders(config: JobConfig) -> list[tuple[str, Path]]:
    """The folders this run writes into, each with its flag: the dump folder (logs, metrics,
    config) and the checkpoint folder where the run saves (not with ``load_only``, a
    validation of saved weights or ``COMM_MODE=local_tensor``, which only read it)."""
    dump = config.job.dump_folder
    if not dump.strip():
        return []
    folders = [("--job.dump_folder", Path(os.path.normpath(dump)))]
    c = config.checkpoint
    saves = c.enable and not c.load_only and not config.validation.only
    if (saves or c.create_seed_checkpoint) and config.comm.mode != "local_tensor":
        folders.append(("--checkpoint.folder", Path(os.path.normpath(Path(dump) / c.folder))))
    return folders


def locked_folders(config: JobConfig) -> list[tuple[str, Path]]:
    """The folders whose lock a run holds (``components/run_lock.py``), each with its flag:
    the dump folder, and the checkpoint folder it saves into (another run may name it as its
    own ``--checkpoint.folder``, inside this run's dump folder or not)."""
    folders = output_folders(config)
    if not folders:
        return []
    dump = folders[0][1].resolve()
    return folders[:1] + [(f, p) for f, p in folders[1:] if p.resolve() != dump]


def unwritable(folder: Path, made: list[Path]) -> str | None:
    """Why this process cannot write in ``folder``, or None: the folder is made where missing
    (each folder made appended to ``made``), and a file of a name of its own (nodes may share
    the folder) written there and removed."""
    missing = [p for p in (folder, *folder.parents) if not exists(p)]
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
                made.append(path)
            except FileExistsError:  # another node's rank made it meanwhile
                if not path.is_dir():
                    raise
        fd, probe = tempfile.mkstemp(prefix=".titan-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def check_writable(config: JobConfig) -> None:
    """Refuse, naming the flag, a folder the run would fail to write into, before it trains
    (a save that fails after hours of training loses them); a refusal removes the folders
    made for the check."""
    made: list[Path] = []
    for flag, folder in output_folders(config):
        if (why := unwritable(folder, made)) is not None:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise ConfigError(f"{flag}: cannot write in {folder} ({why}); choose another folder")


def exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a folder on the way that cannot be searched: found at write time
        return False

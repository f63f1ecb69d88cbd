"""How a run keeps its checkpoint folder: the steps it purges (``--checkpoint.keep_latest_k``,
renamed before they are removed), the newer steps a rewind sets aside (``step-N.replaced``,
never loaded or purged), whether newer steps continue a rewound run, and forks refused from a
folder of the run's own. No step is removed that a run still needs to resume."""

import os
import shutil
from pathlib import Path

from torchtitan.components.checkpoint_files import (
    complete_checkpoints,
    free_name,
    saved_config,
    saved_state_keys,
    verify,
)
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger


def step_of(path: Path) -> int:
    """N of a ``step-N`` folder."""
    return int(path.name.removeprefix("step-"))


def continues_from(path: Path) -> int | None:
    """The ``--checkpoint.load_step`` of the run that saved ``path`` (None: none, or no
    config saved with it)."""
    config = saved_config(path)
    step = (config or {}).get("checkpoint", {}).get("load_step", -1)
    return step if isinstance(step, int) and step >= 0 else None


def rewind(folder: Path, step: int) -> tuple[Path, list[Path]]:
    """What ``--checkpoint.load_step step`` resumes in ``folder``, and the newer steps it sets
    aside. Newer steps all saved by a run resumed from the same step (this command, restarted
    or requeued; their ``config.toml`` says so) continue it: the newest whose files are all
    there is resumed and nothing is set aside. Otherwise (a rewind past them) ``step-N``, and
    the newer steps, so that this run's checkpoints do not mix with theirs."""
    newer = [p for p in complete_checkpoints(folder) if step_of(p) > step]
    if newer and all(continues_from(p) == step for p in newer):
        whole = [p for p in newer if verify(p, checksums=False) is None]
        if whole:
            logger.info(
                f"--checkpoint.load_step {step}: {whole[-1].name} continues a run resumed from "
                f"step-{step} with that flag: resuming from it (to rewind to step-{step} again, "
                "move the newer checkpoints out of the folder)"
            )
            return whole[-1], []
        return folder / f"step-{step}", []  # all damaged: kept, for inspection
    return folder / f"step-{step}", newer


def set_aside(paths: list[Path]) -> list[Path]:
    """Rename each ``step-N`` to ``step-N.replaced`` (or ``...-2``, ...): kept, but never
    loaded or purged by a run. Returns the new names."""
    moved = []
    for path in paths:
        aside = free_name(path.with_name(f"{path.name}.replaced"))
        os.replace(path, aside)
        moved.append(aside)
    return moved


def refuse_fork_of_own(path: Path, owned: dict[str, Path]) -> None:
    """A fork's source (``--checkpoint.initial_load_path`` with
    ``--checkpoint.no_initial_load_model_only``) inside a folder of this run's (``owned``, by
    flag name): its records would be the source's (set aside as an earlier run's), or its
    checkpoints mixed with the source's, the newest of them resumed instead of ``path``."""
    for name, own in owned.items():
        if own.resolve() == path.resolve() or own.resolve() in path.resolve().parents:
            raise ConfigError(
                f"--checkpoint.initial_load_path {path} with "
                f"--checkpoint.no_initial_load_model_only: that checkpoint is inside this "
                f"run's --{name} {own}; fork into another --{name}, or resume that run there "
                "(drop --checkpoint.initial_load_path)"
            )


REMOVING = ".removing"  # a purged step-N on its way out: never loaded, removed on start


def purge(folder: Path, k: int, every: int) -> None:
    """``--checkpoint.keep_latest_k``: remove all but the ``k`` newest complete checkpoints
    (0: none), keeping the milestones of ``--checkpoint.keep_every`` (``every``), the newest
    full one (weights-only saves may be newer), and any damaged one. Each is renamed first
    (``step-N.removing``), so a kill while it is removed leaves no half of a ``step-N``."""
    if k <= 0:
        return
    found = complete_checkpoints(folder)
    whole = (p for p in reversed(found) if verify(p, checksums=False) is None)
    full = next((p for p in whole if saved_state_keys(p) != {"model"}), None)
    for old in found[:-k]:
        if (every and step_of(old) % every == 0) or old == full:
            continue  # a milestone, or the newest that resumes training
        problem = verify(old, checksums=False)
        if problem is not None:  # its data may still be what someone needs: never delete
            logger.warning(f"Keeping damaged checkpoint {old} for inspection: {problem}")
            continue
        doomed = free_name(old.with_name(old.name + REMOVING))
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        logger.info(f"Removed old checkpoint {old} (--checkpoint.keep_latest_k {k})")

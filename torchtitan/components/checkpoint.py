"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume exactly, reshard.

Layout under ``<job.dump_folder>/<checkpoint.folder>/``::

    step-100/            a complete checkpoint: DCP shards (*.distcp), .metadata, manifest.json
    step-200/
    step-300.tmp/        being written (or left by a crash): never loaded, removed on start

Every rank writes its shards into ``step-N.tmp``; once DCP reports all ranks done, rank 0
writes ``manifest.json`` (every file, its size and CRC-32) and renames the folder to ``step-N``.
Loading checks the manifest first, so a torn or corrupt checkpoint is skipped with a warning
when resuming from the latest, and is an error when asked for by step. What is saved (the
state objects) is in ``checkpoint_states``; what is on disk in ``checkpoint_files``; loading
model weights alone (seed checkpoints, initial loads, LoRA's frozen weights) in
``checkpoint_weights``; saving in the background (async modes) in ``checkpoint_async``.

What is saved: ``model`` and ``optimizer`` (DCP state-dict APIs, so any sharding loads into any
other), ``lr_scheduler``, ``dataloader`` (one entry per data-parallel rank) and ``train_state``
(step, tokens seen, RNG state). Non-tensor values are read back with ``weights_only=True``.
"""

import copy
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils._pytree as pytree
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components import checkpoint_hf
from torchtitan.components.chat_template import TEMPLATE_FILE
from torchtitan.components.checkpoint_async import BackgroundSaves
from torchtitan.components.checkpoint_files import (
    CONFIG_FILE,
    FROZEN_SOURCE,
    MANIFEST,
    complete_checkpoints,
    dcp_no_dist,
    free_bytes,
    is_disk_full,
    is_os_error,
    manifest_entries,
    manifest_step,
    missing_optimizer_key,
    other_optimizer_message,
    safe_load,
    saved_state_keys,
    verify,
    weights_only_message,
    write_durably,
)
from torchtitan.components.checkpoint_folder import (
    REMOVING,
    purge,
    refuse_fork_of_own,
    rewind,
    set_aside,
    step_of,
)
from torchtitan.components.checkpoint_states import (
    OPTIONAL_STATES,
    match_dataloader_layout,
    match_semi_sync_layout,
)
from torchtitan.components.checkpoint_weights import WeightsLoader
from torchtitan.components.checkpoint_writer import CheckpointWriter
from torchtitan.components.optimizer import Optimizers
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import apply_toml
from torchtitan.distributed import local_tensor
from torchtitan.tools.logging import logger
from torchtitan.tools.memory_estimate import format_bytes, local_bytes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointManager:
    """Decides when to save and what to load, and keeps the folder consistent."""

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        dump_folder: str,
        states: dict[str, Stateful],
        device_type: str,
        run_config: str | None = None,
        hf: "checkpoint_hf.HFIO | None" = None,
        chat_template: str | None = None,
        writes: bool = True,
    ):
        self.config = config
        self.writes = writes and not config.load_only
        """Whether this run writes the folder (a validation of saved weights, or ``load_only``,
        reads a folder another run may be saving into)."""
        self.hf = hf
        """Hugging Face import/export for this model (``None``: the family has no adapter)."""
        self.dump_folder = Path(dump_folder)
        self.folder = self.dump_folder / config.folder
        self.states = states
        self.run_config = run_config  # resolved TOML, saved in every checkpoint
        self.chat_template = chat_template  # a fine-tuning run's, saved in every checkpoint
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.background = BackgroundSaves(config.async_mode, device_type)
        """Async saves: the one in flight, its staging copy, the stager and its own group."""
        self.loaded_from: Path | None = None
        """The full checkpoint this run resumed (or forked) from (not a seed or initial load)."""
        self.forked_from: Path | None = None
        """Another run's full checkpoint this run started from (it continues no run of its own
        folder)."""
        self._verdicts: dict[Path, str | None] = {}
        self.weights = WeightsLoader(
            model=states["model"],
            initial_load_path=config.initial_load_path,
            hf=hf,
            run_config=run_config,
            verify=self._verify,
        )
        """Loads model weights alone (seed and initial loads, LoRA's frozen weights)."""
        if config.enable and local_tensor.is_simulating():
            logger.info(
                "COMM_MODE=local_tensor: checkpoints are read (model weights: a seed "
                "checkpoint or --checkpoint.initial_load_path), never written"
            )
        self._remove_incomplete()

    # ---- loading ---------------------------------------------------------------------------

    def saved_config(self, current: JobConfig) -> JobConfig | None:
        """The ``JobConfig`` the loaded checkpoint's run was saved with (``current`` with the
        saved values over it), or ``None``: nothing loaded, an older checkpoint without a
        config, or one written by another version of the config."""
        path = self.loaded_from
        if path is None or not (path / CONFIG_FILE).is_file():
            return None
        saved = copy.deepcopy(current)
        try:
            apply_toml(saved, path / CONFIG_FILE)
        except ConfigError:
            return None
        return saved

    def load(self) -> int:
        """Restore the newest complete checkpoint (or ``load_step``); return its step, or 0."""
        c = self.config
        if c.initial_load_path and not c.initial_load_model_only:  # a fork: not of its own
            owned = {"job.dump_folder": self.dump_folder, "checkpoint.folder": self.folder}
            refuse_fork_of_own(Path(c.initial_load_path), owned)
        if c.load_step >= 0:
            path, newer = self._branch(c.load_step)
            problem = self._verify(path)
            if problem:
                raise ConfigError(f"--checkpoint.load_step={c.load_step}: {problem}")
            step = self._load(path)
            self._set_aside(newer, c.load_step)  # once step-N loaded: a refusal moves nothing
            return step
        found = complete_checkpoints(self.folder)
        damaged = []
        for path in reversed(found):
            problem = self._verify(path)
            if problem is None:
                if c.initial_load_path and not self.weights.frozen_left_out():
                    logger.warning(
                        f"--checkpoint.initial_load_path {c.initial_load_path} is not used: "
                        f"{self.folder} has checkpoints, resuming from {path.name}"
                    )
                return self._load(path)
            logger.warning(f"Skipping checkpoint {path}: {problem}")
            damaged.append(path.name)
        if damaged:
            # Starting over would overwrite them with new steps: the user decides.
            raise ConfigError(
                f"every checkpoint in {self.folder} is damaged ({', '.join(reversed(damaged))}; "
                "the warnings above say how), so the run cannot resume; to start over, move "
                f"the folder aside or use another --job.dump_folder; to use one of them anyway, "
                "repair it and pass --checkpoint.load_step N"
            )
        if c.initial_load_path and not c.initial_load_model_only:
            return self._fork(Path(c.initial_load_path))
        if c.initial_load_path:
            self.weights.load_initial()
        else:
            logger.info(f"No checkpoint in {self.folder}: training from step 0")
        return 0

    def _branch(self, step: int) -> tuple[Path, list[Path]]:
        """What ``--checkpoint.load_step`` resumes, and the newer steps a rewind sets aside
        (``checkpoint_folder.rewind``), as rank 0 decides it: every rank the same."""
        plain = (self.folder / f"step-{step}", [])
        if not self.writes or local_tensor.is_simulating():
            return plain
        return _rank0s(rewind(self.folder, step) if self.rank == 0 else plain)

    def _set_aside(self, newer: list[Path], step: int) -> None:
        """Rank 0 renames a rewind's newer steps (``step-M.replaced``); every rank waits."""
        failed = None
        if self.rank == 0 and newer:
            try:
                moved = set_aside(newer)
                logger.warning(
                    f"--checkpoint.load_step {step}: {len(moved)} newer checkpoint(s) set aside "
                    f"({', '.join(p.name for p in moved)}), never deleted: this run goes on "
                    f"from step-{step}"
                )
            except OSError as e:
                failed = f"--checkpoint.load_step {step}: cannot set newer checkpoints aside ({e})"
        if (failed := _rank0s(failed)) is not None:
            raise ConfigError(failed)

    def _fork(self, path: Path) -> int:
        """Everything of another run's full ``step-N`` (``--checkpoint.no_initial_load_model_only``):
        this run goes on from step N."""
        flag = f"--checkpoint.initial_load_path {path} with --checkpoint.no_initial_load_model_only"
        if checkpoint_hf.is_hf_folder(path):
            raise ConfigError(
                f"{flag}: a Hugging Face folder holds weights only; drop "
                "--checkpoint.no_initial_load_model_only to start from them at step 0"
            )
        if (problem := self._verify(path)) is not None:
            raise ConfigError(f"{flag}: {problem}")
        if saved_state_keys(path) == {"model"}:
            raise ConfigError(
                f"{flag}: it holds weights only (a seed checkpoint or a model-only save); drop "
                "--checkpoint.no_initial_load_model_only to start from them at step 0"
            )
        self._load(path)
        self.forked_from = path
        step = self.states["train_state"].step  # 0 when excluded from loading
        logger.info(f"Forked {path}: this run goes on from step {step} in {self.folder}")
        return step

    def _verify(self, path: Path) -> str | None:
        """``verify`` with checksums, the files' CRCs split over the ranks (each reads its
        share once) and the verdicts gathered, so every rank picks the same checkpoint. A
        path is verified once per run."""
        if path in self._verdicts:
            return self._verdicts[path]
        if not dist.is_initialized() or dist.get_world_size() == 1:
            verdict = verify(path)
        else:
            world = dist.get_world_size()
            mine = verify(path, share=(self.rank, world))
            verdicts: list[str | None] = [None] * world
            dist.all_gather_object(verdicts, mine)
            verdict = next((v for v in verdicts if v is not None), None)
        self._verdicts[path] = verdict
        return verdict

    def _load(self, path: Path) -> int:
        keys = saved_state_keys(path)
        if keys == {"model"}:
            # A seed checkpoint (or, with load_only, any weights): start from these weights.
            if path.name != "step-0" and not self.config.load_only:
                raise ConfigError(weights_only_message(self.folder, path))
            self.weights.load_model_only(path)
            return 0
        if local_tensor.is_simulating():
            raise ConfigError(
                f"checkpoint {path} holds training state, which COMM_MODE=local_tensor cannot "
                "load (DCP cannot gather LocalTensors); it loads model weights only: a seed "
                "checkpoint (step-0) or --checkpoint.initial_load_path with a weights-only save"
            )
        self.loaded_from = path
        wanted = {k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading}
        for name in set(OPTIONAL_STATES) & set(wanted) - keys:
            logger.info(
                f"Checkpoint {path} has no {name} state (saved without it): it starts empty"
            )
            del wanted[name]
        match_semi_sync_layout(path, wanted, keys, self.states.get("semi_sync"))
        missing = set(wanted) - keys
        if missing:
            raise ConfigError(
                f"checkpoint {path} has no {', '.join(sorted(missing))} state; pass "
                f"--checkpoint.exclude_from_loading {' '.join(sorted(missing))} to skip it"
            )
        if "model" in wanted:
            # (For adapter-only saves this first loads the frozen weights they train on.)
            self.weights.before_full_load(path)
        match_dataloader_layout(path, wanted)
        logger.info(f"Loading checkpoint {path} ({', '.join(wanted)})")
        try:
            safe_load(wanted, path)
        except (RuntimeError, CheckpointException) as e:
            missing = missing_optimizer_key(e)
            if missing is None:
                raise
            raise ConfigError(other_optimizer_message(path, missing)) from None
        return manifest_step(path)

    # ---- saving ----------------------------------------------------------------------------

    def last_complete(self) -> Path | None:
        """The newest complete checkpoint on disk, if any."""
        for path in reversed(complete_checkpoints(self.folder)):
            if verify(path, checksums=False) is None:
                return path
        return None

    def should_save(self, step: int, *, last: bool) -> bool:
        c = self.config
        if not c.enable or c.load_only or local_tensor.is_simulating():
            return False
        return last or step % c.interval == 0 or (step == 1 and c.enable_first_step_checkpoint)

    def save(
        self, step: int, *, last: bool = False, model_only: bool = False, now: bool = False
    ) -> None:
        """Write ``step-N``: in the background with async modes, unless ``last`` or ``now`` (a
        preemption's, written before the job is killed); ``last`` keeps only the weights with
        ``last_save_model_only`` (in ``export_dtype``)."""
        self._wait_for_previous(step, last=last)
        found = complete_checkpoints(self.folder) if model_only else []
        if found and step_of(found[-1]) > step:  # a seed: runs would resume those instead
            raise ConfigError(
                f"--checkpoint.create_seed_checkpoint: {self.folder} holds checkpoints up to "
                f"{found[-1].name}, which runs resume instead of a seed; write it into an "
                "empty --checkpoint.folder"
            )
        if model_only or (last and self.config.last_save_model_only):
            state: dict[str, Any] = {"model": self._export_model_state()}
        else:
            state = dict(self.states)
        tmp = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as e:  # a folder that went read-only or away since the start
                raise self._save_failed(step, e) from None
        _barrier()
        self.background.join_prestage()
        if self.background.enabled and not (last or now):
            self.background.start(state, tmp, step)
            return
        try:
            dcp.save(state, storage_writer=CheckpointWriter(str(tmp)), no_dist=dcp_no_dist())
            self._finalize(step)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise self._save_failed(step, e) from None
        if last and self.config.last_save_in_hf and self.hf is not None:
            # LoRA adapters also on their own, in PEFT's format, for the HF model they adapt.
            initial = self.config.initial_load_path
            hf_base = initial and checkpoint_hf.is_hf_folder(initial)
            base = str(Path(initial).absolute()) if hf_base else None
            self.hf.save(
                self.folder / f"hf-step-{step}",
                _DTYPES[self.config.export_dtype],
                peft_folder=self.folder / f"peft-step-{step}" if self.weights.adapted() else None,
                base_model=base,
            )

    def wait_for_staging(self) -> None:
        """Before the optimizer step: the state of an ``async_with_pinned_mem`` save is copied."""
        self.background.wait_for_staging()

    def poll(self) -> None:
        """Finalize a background save that has finished; once the optimizer has state, start
        allocating the async staging buffers in the background (cheap; call every step)."""
        pending = self.background.pending
        if pending is not None and pending.future.done():
            self.finish_pending()
        if not self.config.load_only:
            optimizers = self.states.get("optimizer")
            # An optimizer without state would be stepped (lr 0) by DCP to create it.
            if isinstance(optimizers, Optimizers) and optimizers.has_state:
                self.background.prestage_once(self.states)

    def _wait_for_previous(self, step: int, *, last: bool) -> None:
        """Finish the previous background save; say so when the training loop had to wait."""
        pending = self.background.pending
        busy = pending is not None and not pending.future.done()
        start = time.perf_counter()
        self.finish_pending()
        waited = time.perf_counter() - start
        if busy and not last and waited > 0.1:
            logger.warning(
                f"Checkpoint step-{pending.step} was still being written: step {step} waited "
                f"{waited:.1f} s for it; a larger --checkpoint.interval avoids the wait"
            )

    def finish_pending(self) -> None:
        pending = self.background.take_pending()
        if pending is None:
            return
        try:
            pending.future.result()
            self._finalize(pending.step)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise self._save_failed(pending.step, e) from None

    def _save_failed(self, step: int, error: BaseException) -> BaseException:
        """One line for a save the file system refused (a full disk says so, with what the
        checkpoint needs, instead of torch's ``enforce fail at inline_container.cc``); the
        partial ``step-N.tmp``, this run's own, is removed. Any other error is returned as it
        is: a bug keeps its traceback."""
        if not is_os_error(error):
            return error
        if self.rank == 0:
            shutil.rmtree(self.folder / f"step-{step}.tmp", ignore_errors=True)
        last = self.last_complete()
        kept = f"the last complete checkpoint is {last}" if last else "no checkpoint is complete"
        free = free_bytes(self.folder)
        if is_disk_full(error) or (free is not None and free < 1 << 20):
            return ConfigError(
                f"no space left on device saving checkpoint step-{step} in {self.folder}: it "
                f"needs about {format_bytes(self._state_bytes()).strip()} on this rank, "
                f"{format_bytes(free or 0).strip()} are free; free space or choose another "
                f"--checkpoint.folder ({kept})"
            )
        reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        return ConfigError(
            f"cannot save checkpoint step-{step} in {self.folder}: {reason[:200]} ({kept}); "
            "make the folder writable again and run the same command to resume, or choose "
            "another --checkpoint.folder"
        )

    def _state_bytes(self) -> int:
        """Bytes of this rank's tensors in the full state (what a save writes of it)."""
        return local_bytes(
            pytree.tree_leaves(
                {
                    k: v.state_dict() if isinstance(v, Stateful) else v
                    for k, v in self.states.items()
                }
            )
        )

    def _finalize(self, step: int) -> None:
        """On rank 0, once every rank's files are written: manifest, rename, purge old."""
        if self.rank == 0:
            tmp, final = self.folder / f"step-{step}.tmp", self.folder / f"step-{step}"
            if self.run_config is not None:
                write_durably(tmp / CONFIG_FILE, self.run_config)
            if self.chat_template is not None:  # what samples and exports of the step use
                write_durably(tmp / TEMPLATE_FILE, self.chat_template)
            if self.weights.frozen_left_out():
                write_durably(
                    tmp / FROZEN_SOURCE, json.dumps(self.weights.frozen_source(), indent=1)
                )
            files, crcs = manifest_entries(tmp)
            manifest = {"step": step, "files": files, "crc32": crcs}
            write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1))
            if final.exists():
                # Another run's step-N (resumed from an earlier step, or damaged and skipped):
                # keep it, under a name no later run loads or purges.
                [aside] = set_aside([final])
                logger.warning(f"{final} existed (not written by this run): moved to {aside}")
            os.replace(tmp, final)
            logger.info(f"Saved checkpoint {final}")
            purge(self.folder, self.config.keep_latest_k, self.config.keep_every)

    def _export_model_state(self) -> dict[str, Any]:
        dtype = _DTYPES[self.config.export_dtype]
        state = self.states["model"].state_dict()
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}

    def _remove_incomplete(self) -> None:
        # A run that only reads (a simulation too) may read beside a live run that saves:
        # its step-N.tmp is not this run's to remove.
        writes = self.writes and not local_tensor.is_simulating()
        if self.rank == 0 and writes and self.folder.is_dir():
            for tmp in self.folder.glob("step-*.tmp"):
                logger.warning(f"Removing incomplete checkpoint {tmp}")
                shutil.rmtree(tmp, ignore_errors=True)
            for doomed in self.folder.glob(f"step-*{REMOVING}*"):  # a purge a kill interrupted
                shutil.rmtree(doomed, ignore_errors=True)
        _barrier()

    def close(self) -> None:
        self.finish_pending()
        self.background.close()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank0s(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank (what rank 0 decided about the folder)."""
    box = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]

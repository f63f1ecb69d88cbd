"""Reading model weights alone, apart from a full resume: seed checkpoints (``step-0``),
``--checkpoint.initial_load_path`` (a Hugging Face folder or a ``step-N``), weights-only
checkpoints under ``--checkpoint.load_only``, and the frozen weights under LoRA adapters that
checkpoints leave out (``--lora.save_adapters_only``: they are re-read from the initial load
path, whose fingerprint each such checkpoint records in ``frozen_source.json``).

Before any tensor is read, the saved names and shapes are compared with this model's, so another
model's checkpoint is refused in one line naming the config values that differ.
"""

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchtitan.components import checkpoint_hf, lora
from torchtitan.components.checkpoint_files import (
    CONFIG_FILE,
    frozen_source_changed,
    model_mismatch,
    read_full_model,
    safe_load,
    saved_config,
    saved_tensor_metadata,
    weights_fingerprint,
)
from torchtitan.components.checkpoint_states import ModelState
from torchtitan.config.errors import ConfigError
from torchtitan.distributed import local_pipeline, local_tensor
from torchtitan.tools.logging import logger


class WeightsLoader:
    """Loads model weights into ``model`` (the checkpointed ``ModelState``) from anything but a
    full checkpoint of this run's kind; ``verify(path)`` is the manager's manifest check (a
    problem, or ``None``), shared so that each path is verified once."""

    def __init__(
        self,
        *,
        model: ModelState,
        initial_load_path: str | None,
        hf: "checkpoint_hf.HFIO | None",
        run_config: str | None,
        verify: Callable[[Path], str | None],
    ):
        self.model = model
        self.initial_load_path = initial_load_path
        self.hf = hf
        self.run_config = run_config
        self._verify = verify
        self._frozen_source_print: dict[str, Any] | None = None

    def before_full_load(self, path: Path) -> None:
        """Checks (and, for adapter-only checkpoints, loads the frozen weights) before the
        full checkpoint ``path`` is read into this model."""
        self.check_model_fits(path, flag="", frozen_unread=self.frozen_left_out())
        self.check_lora_settings(path)
        if self.frozen_left_out():
            source = Path(self.initial_load_path)
            if (changed := frozen_source_changed(path, source)) is not None:
                raise ConfigError(changed)
            self.load_initial()

    def load_initial(self) -> None:
        """The weights of ``--checkpoint.initial_load_path``: an HF folder or a ``step-N``."""
        path = self.initial_load_path
        if path is None:
            raise ConfigError(
                "the checkpoint holds LoRA adapters without the frozen weights "
                "(--lora.save_adapters_only): pass the --checkpoint.initial_load_path it was "
                "trained from"
            )
        if self.frozen_left_out() and self._frozen_source_print is None and Path(path).is_dir():
            self.frozen_source()  # what the adapters train on, as it is when read
        if checkpoint_hf.is_hf_folder(path):
            if self.hf is None:
                raise ConfigError(
                    f"--checkpoint.initial_load_path {path} is a Hugging Face "
                    "folder, and this model family has no state-dict adapter to read it"
                )
            logger.info(f"Loading Hugging Face weights from {path}")
            self.hf.load(path)
        else:
            self.load_model_only(Path(path))

    def check_lora_settings(self, path: Path) -> None:
        """Adapters trained with another alpha compute another model (it rescales them without
        changing a shape): refuse loading them into this run."""
        saved = (saved_config(path) or {}).get("lora")
        here = tomllib.loads(self.run_config).get("lora") if self.run_config else None
        if not (saved or {}).get("rank") or not (here or {}).get("rank"):
            return  # without adapters on either side the model's names differ: refused apart
        # (Another rank or set of layers changes the tensors: the shape check refuses it.)
        for key in ("alpha",):
            theirs, ours = saved.get(key), here.get(key)
            if theirs != ours:
                raise ConfigError(
                    f"checkpoint {path} holds LoRA adapters trained with --lora.{key} {theirs}, "
                    f"this run has {ours}: they would compute another model; resume with the "
                    "same --lora settings"
                )

    def frozen_source(self) -> dict[str, Any]:
        """Where the frozen weights come from, with the folder's fingerprint (taken once)."""
        if self._frozen_source_print is None:
            source = Path(self.initial_load_path)
            self._frozen_source_print = {
                "initial_load_path": str(self.initial_load_path),
                "resolved": str(source.resolve()),
                "files": weights_fingerprint(source),
            }
        return self._frozen_source_print

    def adapted(self) -> bool:
        """Whether the model has LoRA adapters."""
        return any(lora.is_adapted(m) for part in self.model.model_parts for m in part.modules())

    def frozen_left_out(self) -> bool:
        """Whether this run's checkpoints leave the frozen weights out (LoRA's
        ``--lora.save_adapters_only``): they come from ``--checkpoint.initial_load_path``."""
        return bool(self.model.leave_out)

    def check_model_fits(
        self, path: Path, *, flag: str, model: ModelState | None = None, frozen_unread: bool = False
    ) -> None:
        """Names and shapes of the saved model tensors against this model's (``model``, by
        default the saved state's), before loading; ``frozen_unread``: the checkpoint's frozen
        weights (all but LoRA adapters) are not read, so it may hold more of them."""
        model = model or self.model
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if dist.is_initialized() and not local_tensor.is_simulating():
            # Pipeline stages hold different parts: compare the whole model's names.
            every_rank: list[dict] = [{}] * dist.get_world_size()
            dist.all_gather_object(every_rank, shapes)
            shapes = {k: v for rank_shapes in every_rank for k, v in rank_shapes.items()}
        # A simulated pipeline rank (a thread) sees only its own stages' names.
        partial = local_pipeline.first_rank() is not None
        unread = (lambda name: not lora.is_adapter_name(name)) if frozen_unread else None
        problem = model_mismatch(path, shapes, partial=partial, unread=unread)
        if problem is None:
            return
        written_by = saved_config(path) or {}
        run = tomllib.loads(self.run_config) if self.run_config else {}
        differ = [
            (section, k, saved[k], here[k])
            for section in ("model", "lora")
            # Configs from before LoRA existed have no [lora] section: it was off.
            for saved, here in [(written_by.get(section, {"rank": 0}), run.get(section, {}))]
            for k in sorted(saved)
            if k in here and saved[k] != here[k]
        ]
        if differ:
            cause = "it was saved with " + ", ".join(
                f"--{section}.{k} {theirs} (this run: {ours})"
                for section, k, theirs, ours in differ
            )
        elif written_by:
            cause = f"compare the [model] section of {path / CONFIG_FILE} with this run's"
        else:
            cause = "was it saved with another --model.flavor?"
        raise ConfigError(
            f"{flag}checkpoint {path} does not fit this model: {problem}; {cause}; load a "
            "checkpoint of this model, or train it in another --job.dump_folder"
        )

    def load_model_only(self, path: Path) -> None:
        problem = self._verify(path)
        if problem:
            raise ConfigError(f"--checkpoint.initial_load_path {path}: {problem}")
        model = self._model_to_load(path)
        # (frozen weights it holds but that come from the initial load instead are not read)
        flag = "--checkpoint.initial_load_path: "
        frozen_unread = any(not lora.is_adapter_name(k) for k in model.leave_out)
        self.check_model_fits(path, flag=flag, model=model, frozen_unread=frozen_unread)
        logger.info(f"Loading model weights from {path}")
        if local_tensor.is_simulating():
            # DCP cannot gather LocalTensors: read the whole model on the host (as one
            # process would), then every simulated rank copies its shards out of it.
            full = read_full_model(path)
            for part in model.model_parts:
                local_tensor.copy_full_state_(part, full, leave_out=model.leave_out)
            return
        safe_load({"model": model}, path)

    def _model_to_load(self, path: Path) -> ModelState:
        """The model to load weights into from ``path`` (model weights only). Without its LoRA
        adapters when the checkpoint has none (the frozen model fine-tuning starts from): they
        keep their initialisation. Without the frozen weights when they come from
        ``--checkpoint.initial_load_path`` instead, loaded first: the checkpoint holds only
        adapters, or this run saves only adapters (its resumes read the frozen weights from
        there, so the adapters must train on those, not on a seed checkpoint's)."""
        model = self.model.whole()
        adapters = {k for k in model.state_dict() if lora.is_adapter_name(k)}
        if not adapters:
            return model
        saved = {k.removeprefix("model.") for k in saved_tensor_metadata(path)}
        leave_out = set()
        if adapters & saved:
            self.check_lora_settings(path)
        else:
            logger.info(f"{path} has no LoRA adapters: they start from their initialisation")
            leave_out |= adapters
        frozen = lora.frozen_names(self.model.model_parts)
        initial = self.initial_load_path
        is_initial = initial is not None and Path(path).resolve() == Path(initial).resolve()
        if frozen and not frozen & saved and is_initial:
            raise ConfigError(
                f"--checkpoint.initial_load_path {path} holds LoRA adapters without the frozen "
                "weights (--lora.save_adapters_only); start from the checkpoint its run started "
                "from, or from an HF export of it"
            )
        if frozen and not is_initial and (not frozen & saved or self.frozen_left_out()):
            changed = initial and frozen_source_changed(path, Path(initial))
            if changed:
                raise ConfigError(changed)
            self.load_initial()
            leave_out |= frozen
        return model.without(leave_out) if leave_out else model

"""What a checkpoint holds: the model parts under the whole model's names, per-rank dataloader
state, and the dict of states the trainer hands to ``CheckpointManager``."""

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint_files import saved_ranks, saved_replicas
from torchtitan.components.lr_scheduler import LRSchedulers
from torchtitan.components.optimizer import Optimizers
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger


class ModelState(Stateful):
    """The parameters of this rank's model parts as DCP sees them (sharded DTensors stay
    sharded), under the names of the whole model: the parts' names do not overlap, so a
    checkpoint saved with one split (pipeline stages) loads into any other."""

    def __init__(
        self, model_parts: Sequence[nn.Module], *, leave_out: frozenset[str] = frozenset()
    ):
        self.model_parts = list(model_parts)
        self.leave_out = leave_out

    def whole(self) -> "ModelState":
        """The same model with nothing left out."""
        return ModelState(self.model_parts)

    def without(self, names: set[str]) -> "ModelState":
        """The same model with ``names`` neither saved nor loaded (LoRA adapters when a
        checkpoint of the frozen model loads: they keep their initialisation)."""
        return ModelState(self.model_parts, leave_out=self.leave_out | frozenset(names))

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        return {k: v for k, v in merged.items() if k not in self.leave_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part takes its own names from the merged dict (a pipeline stage holds a few);
        # the manager has checked the names and shapes against the whole model's before.
        options = StateDictOptions(strict=False)
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=options)


class SyncedModelState(ModelState):
    """Under semi-synchronous training, the model as the replicas last agreed on it: each
    trainable weight's synced value (``view``) is saved, the same on every replica, so the
    checkpoint's ``model`` is one model. Loading fills the model (the replicas' own weights
    follow from the ``semi_sync`` state)."""

    def __init__(self, inner: ModelState, view: Callable[[dict[str, Any]], dict[str, Any]]):
        super().__init__(inner.model_parts, leave_out=inner.leave_out)
        self.view = view

    def without(self, names: set[str]) -> "SyncedModelState":
        return SyncedModelState(super().without(names), self.view)

    def state_dict(self) -> dict[str, Any]:
        return self.view(super().state_dict())


class _FlatOptimizers(Stateful):
    """The optimizers' state under the parameters' names alone: an ordinary run's checkpoint
    loading into every replica of a semi-synchronous one."""

    def __init__(self, optimizers: Optimizers):
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        return self.optimizers.flat_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizers.load_state_dict(state_dict)


def match_semi_sync_layout(
    path: Path, wanted: dict[str, Stateful], saved: set[str], ours: Stateful | None
) -> None:
    """A checkpoint of semi-synchronous training loads into a run (``ours``: its
    ``semi_sync`` state, else ``None``) of as many replicas; an ordinary run's starts every
    replica from its weights and moments; the other way round only its (synced) weights
    load."""
    fresh = f"start from its synced weights with --checkpoint.initial_load_path {path}"
    if ours is None:
        if "semi_sync" in saved and "optimizer" in wanted:
            raise ConfigError(
                f"checkpoint {path} was saved by semi-synchronous training (its optimizer "
                "state is per replica): resume it with the --semi_sync flags and "
                f"--parallelism.data_parallel_replicate_degree it was saved with, or {fresh} "
                "in another --job.dump_folder"
            )
        return
    if "semi_sync" not in saved:
        logger.info(
            f"Checkpoint {path} has no semi_sync state (an ordinary run's): every replica "
            "starts from its weights and optimizer state"
        )
        wanted.pop("semi_sync", None)
        if isinstance(wanted.get("optimizer"), Optimizers):
            wanted["optimizer"] = _FlatOptimizers(wanted["optimizer"])
        return
    replicas, momentum = saved_replicas(path)
    if momentum != ours.diloco:
        method = "diloco" if momentum else "local_sgd"
        raise ConfigError(
            f"checkpoint {path} was saved with --semi_sync.method {method}: resume with it, or "
            f"{fresh} in another --job.dump_folder"
        )
    if replicas != ours.replicas:
        raise ConfigError(
            f"checkpoint {path} holds the weights of {replicas} semi-synchronous replicas, this "
            f"run has {ours.replicas}: resume with --parallelism.data_parallel_replicate_degree "
            f"{replicas}, or {fresh} in another --job.dump_folder"
        )


class PerRankState(Stateful):
    """State kept per data-parallel rank (the dataloader), stored as one serialized item per
    rank (its size varies, so not a tensor) and read back with ``weights_only=True``.

    ``replicated`` says every rank's item is the same (``by_row`` data), so a run with another
    number of ranks can load any of them; ``reading(rank)`` is the view that loads that one.
    """

    def __init__(self, inner: Stateful, *, rank: int, world_size: int, replicated: bool = False):
        self.inner, self.rank, self.world_size = inner, rank, world_size
        self.replicated = replicated

    def reading(self, rank: int) -> "PerRankState":
        return PerRankState(self.inner, rank=rank, world_size=self.world_size, replicated=True)

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.inner.state_dict(), buffer)
        return {f"rank_{self.rank}": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        data = state_dict[f"rank_{self.rank}"]
        self.inner.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))


def match_dataloader_layout(path: Path, wanted: dict[str, Stateful]) -> None:
    """Refuse per-rank dataloader state saved under another DP degree, unless every rank
    reads the whole stream (``by_row``, or one rank): then all ranks here read rank 0's."""
    state = wanted.get("dataloader")
    if not isinstance(state, PerRankState):
        return
    saved = saved_ranks(path, "dataloader")
    if saved == state.world_size:
        return
    if not state.replicated:
        raise ConfigError(
            f"checkpoint {path} holds dataloader state for {saved} data-parallel ranks, "
            f"this run has {state.world_size}: their shards do not line up; resume with "
            f"{saved} data-parallel ranks, or pass --checkpoint.exclude_from_loading "
            "dataloader to restart the data from its beginning (runs that change the "
            "degree keep their place with --training.data_sharding by_row)"
        )
    wanted["dataloader"] = state.reading(0)  # the dataloader checks the saved sharding


def build_checkpoint_states(
    *,
    model_parts: Sequence[nn.Module],
    optimizers: Optimizers,
    lr_schedulers: LRSchedulers,
    dataloader: Stateful,
    train_state: Stateful,
    spikes: Stateful | None = None,
    semi_sync: Stateful | None = None,
    dp_rank: int,
    dp_world_size: int,
) -> dict[str, Stateful]:
    """The checkpoint's states by name; ``spikes`` (``--training.spike_sigma``'s window) only
    where the run judges spikes (one of :data:`OPTIONAL_STATES`); ``semi_sync``
    (``distributed.semi_sync.SemiSync``) only under semi-synchronous training, which saves the
    synced model and each replica's own weights and moments."""
    states: dict[str, Stateful] = {
        "model": ModelState(model_parts),
        "optimizer": optimizers,
        "lr_scheduler": lr_schedulers,
        "dataloader": PerRankState(
            dataloader,
            rank=dp_rank,
            world_size=dp_world_size,
            replicated=getattr(dataloader, "replicated_state", False),
        ),
        "train_state": train_state,
    }
    if spikes is not None:
        states["spikes"] = spikes
    if semi_sync is not None:
        states["model"] = SyncedModelState(states["model"], semi_sync.synced_view)
        states["semi_sync"] = semi_sync
        optimizers.replica_key = f"replica{semi_sync.replica}"
    return states


OPTIONAL_STATES = ("spikes",)
"""States a run may hold that a checkpoint written without them lacks: a resume from one goes
on without them (a run that turned the feature on since)."""

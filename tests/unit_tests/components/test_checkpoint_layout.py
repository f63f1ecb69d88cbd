"""What a checkpoint holds against what this run has: per-rank dataloader state saved by
another number of data-parallel ranks, and model tensors of another shape or name."""

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint_files import SafeLoadPlanner, model_mismatch
from torchtitan.components.checkpoint_states import PerRankState, match_dataloader_layout
from torchtitan.config.errors import ConfigError


class _Position:
    def __init__(self, value: int = -1):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _two_rank_checkpoint(path) -> None:
    """What two ranks write: one serialized item per rank (rank 1's differs, to tell them apart)."""
    items = {}
    for rank in range(2):
        buffer = io.BytesIO()
        torch.save({"value": 10 + rank}, buffer)
        items[f"rank_{rank}"] = buffer.getvalue()
    dcp.save({"dataloader": items}, checkpoint_id=str(path), no_dist=True)


def test_per_rank_state_of_another_degree_is_refused_unless_replicated(tmp_path):
    _two_rank_checkpoint(tmp_path)
    same = {"dataloader": PerRankState(_Position(), rank=1, world_size=2)}
    match_dataloader_layout(tmp_path, same)
    assert same["dataloader"].rank == 1  # same degree: each rank reads its own entry

    sharded = {"dataloader": PerRankState(_Position(), rank=3, world_size=4)}
    with pytest.raises(ConfigError, match="state for 2 data-parallel ranks, this run has 4") as e:
        match_dataloader_layout(tmp_path, sharded)
    assert "--checkpoint.exclude_from_loading dataloader" in str(e.value)
    assert "--training.data_sharding by_row" in str(e.value)


def test_replicated_state_is_read_from_rank_zero_by_every_rank(tmp_path):
    _two_rank_checkpoint(tmp_path)
    position = _Position()
    wanted = {"dataloader": PerRankState(position, rank=3, world_size=4, replicated=True)}
    match_dataloader_layout(tmp_path, wanted)
    dcp.load(wanted, checkpoint_id=str(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    assert position.value == 10
    # The run still saves under its own rank.
    assert list(PerRankState(position, rank=3, world_size=4).state_dict()) == ["rank_3"]


def test_model_mismatch_names_resized_missing_and_unexpected_tensors(tmp_path):
    saved = {"a.weight": torch.zeros(4, 2), "b.weight": torch.zeros(3), "old.bias": torch.zeros(1)}
    dcp.save({"model": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    assert model_mismatch(tmp_path, {k: tuple(v.shape) for k, v in saved.items()}) is None
    problem = model_mismatch(tmp_path, {"a.weight": (4, 3), "b.weight": (3,), "new.bias": (1,)})
    assert problem == (
        "1 tensor(s) differ in shape, e.g. a.weight is [4, 2] there and [4, 3] here; "
        "1 tensor(s) of this model are not in it, e.g. new.bias; "
        "1 of its tensors are not in this model, e.g. old.bias"
    )


def test_only_frozen_weights_a_run_reads_elsewhere_may_be_extra(tmp_path):
    """A LoRA run that takes its frozen weights from another checkpoint may load adapters from
    one holding frozen weights too; any other tensor it lacks (a deeper model's block, another
    set of adapters) is still a mismatch."""
    from torchtitan.components.lora import is_adapter_name

    saved = {
        "a.weight": torch.zeros(2, 2), "a.lora_a": torch.zeros(1, 2),
        "b.weight": torch.zeros(2, 2), "b.lora_a": torch.zeros(1, 2),
    }  # fmt: skip
    dcp.save({"model": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    frozen = lambda name: not is_adapter_name(name)  # noqa: E731
    shapes = {"a.lora_a": (1, 2), "b.lora_a": (1, 2)}
    assert model_mismatch(tmp_path, shapes, unread=frozen) is None
    assert "2 of its tensors are not in this model" in model_mismatch(tmp_path, shapes)
    problem = model_mismatch(tmp_path, {"a.lora_a": (1, 2)}, unread=frozen)
    assert problem is not None and "b.lora_a" in problem

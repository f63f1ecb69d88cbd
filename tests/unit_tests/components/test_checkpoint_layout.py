"""Per-rank dataloader state saved by one number of data-parallel ranks, loaded by another."""

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint import (
    PerRankState,
    _SafeLoadPlanner,
    match_dataloader_layout,
)
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
    dcp.load(wanted, checkpoint_id=str(tmp_path), planner=_SafeLoadPlanner(), no_dist=True)
    assert position.value == 10
    # The run still saves under its own rank.
    assert list(PerRankState(position, rank=3, world_size=4).state_dict()) == ["rank_3"]

"""Loading a checkpoint never runs code hidden in it."""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.components.checkpoint_files import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    saved_state_keys,
)
from torchtitan.config.errors import ConfigError


class _Payload:
    """Unpickling this would call print(...): any callable could be there instead."""

    def __reduce__(self):
        return (print, ("code ran while loading a checkpoint",))


def test_non_tensor_values_are_loaded_with_weights_only(tmp_path, capsys):
    dcp.save({"train_state": {"note": _Payload()}}, checkpoint_id=str(tmp_path), no_dist=True)
    target = {"train_state": {"note": None}}
    # DCP wraps the loader's UnpicklingError; its message names the refused global.
    with pytest.raises(CheckpointException, match="Unsupported global: GLOBAL print"):
        dcp.load(target, checkpoint_id=str(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    assert "code ran" not in capsys.readouterr().out


def test_plain_values_still_load(tmp_path):
    saved = {"train_state": {"note": "resume me", "raw": b"\x00\xff"}}
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    target = {"train_state": {"note": None, "raw": None}}
    dcp.load(target, checkpoint_id=str(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    assert target == saved


def test_crafted_metadata_is_refused_without_running_code(tmp_path, capsys):
    """DCP pickles ``.metadata``; our reader only rebuilds DCP's metadata classes from it."""
    dcp.save(
        {"model": {"w": torch.ones(2, dtype=torch.bfloat16)}},
        checkpoint_id=str(tmp_path),
        no_dist=True,
    )
    metadata = SafeFileSystemReader(str(tmp_path)).read_metadata()  # a real one reads back
    assert metadata.state_dict_metadata["model.w"].properties.dtype == torch.bfloat16
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(ConfigError, match=r"not DCP checkpoint metadata: builtins\.print is not"):
        saved_state_keys(tmp_path)
    assert "code ran" not in capsys.readouterr().out

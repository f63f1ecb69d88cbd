"""Averaging checkpoints' weights (``scripts/average_checkpoints.py``), on small DCP folders
written here."""

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components import checkpoint_average
from torchtitan.components.checkpoint_files import (
    CONFIG_FILE,
    MANIFEST,
    manifest_entries,
    read_full_model,
    saved_state_keys,
    verify,
)
from torchtitan.config.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _step(folder: Path, step: int, model: dict[str, torch.Tensor], **more: torch.Tensor) -> Path:
    """A complete ``step-N`` as the checkpointer writes it: shards, config, manifest."""
    path = folder / f"step-{step}"
    state = {f"model.{k}": v for k, v in model.items()} | more
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / CONFIG_FILE).write_text(f"# step {step}\n")
    files, crcs = manifest_entries(path)
    (path / MANIFEST).write_text(json.dumps({"step": step, "files": files, "crc32": crcs}))
    return path


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "count": torch.tensor([seed, 2 * seed]),
    }


def test_the_average_is_the_mean_of_each_weight_in_its_dtype(tmp_path: Path) -> None:
    models = {step: _model(step) for step in (10, 20, 30)}
    paths = [
        _step(tmp_path / "ckpt", s, m, **{"optimizer.x": torch.ones(2)}) for s, m in models.items()
    ]
    out = tmp_path / "averaged"
    # Small chunks: every tensor read on its own.
    assert checkpoint_average.average(paths, out, chunk_bytes=16) == 30
    assert verify(out) is None and saved_state_keys(out) == {"model"}
    got = read_full_model(out)
    for name in ("w", "half"):
        mean = sum(m[name].to(torch.float64) for m in models.values()) / 3
        assert got[name].dtype == models[10][name].dtype
        assert torch.equal(got[name], mean.to(got[name].dtype)), name
    assert torch.equal(got["count"], models[30]["count"])  # not a weight: the newest's
    assert (out / CONFIG_FILE).read_text() == "# step 30\n"
    assert json.loads((out / "averaged_from.json").read_text())["steps"] == [10, 20, 30]


def test_last_k_picks_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    for step in (2, 4, 6, 8):
        _step(folder, step, _model(step))
    (folder / "step-10.tmp").mkdir()  # an unfinished save is not a checkpoint
    picked = checkpoint_average.sources([folder], 3)
    assert [p.name for p in picked] == ["step-4", "step-6", "step-8"]
    with pytest.raises(ConfigError, match=r"--last 5: .* holds 4 complete checkpoint\(s\)"):
        checkpoint_average.sources([folder], 5)
    with pytest.raises(ConfigError, match="needs two checkpoints or more"):
        checkpoint_average.sources([folder / "step-2"], None)


def test_refusals_name_what_differs_and_nothing_is_overwritten(tmp_path: Path) -> None:
    a = _step(tmp_path / "ckpt", 1, _model(1))
    other = _model(2) | {"w": torch.zeros(4, 4)}
    b = _step(tmp_path / "other", 2, other)
    with pytest.raises(ConfigError, match=r"not the same model: w is \[4, 4\] float32 there, "):
        checkpoint_average.average([a, b], tmp_path / "out")
    c = _step(tmp_path / "third", 3, _model(3))
    shard = next(c.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="third/step-3: .*crc32 differs"):
        checkpoint_average.average([a, c], tmp_path / "out")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep").write_text("mine")
    d = _step(tmp_path / "fourth", 4, _model(4))
    with pytest.raises(ConfigError, match="taken exists"):
        checkpoint_average.average([a, d], taken)
    assert [p.name for p in taken.iterdir()] == ["keep"]
    assert not (tmp_path / "out").exists()

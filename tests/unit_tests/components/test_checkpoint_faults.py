"""Checkpoint faults on one process: nothing saved is overwritten or purged unless this run
wrote it, corruption of the same size is caught by the checksums, a full disk says so."""

import errno
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpoint_files import MANIFEST, verify
from torchtitan.components.checkpoint_states import ModelState
from torchtitan.components.checkpoint_writer import CheckpointWriter
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Checkpoint as CheckpointConfig


class _Progress(Stateful):
    """A training state besides the weights (a weights-only folder would be an export)."""

    def __init__(self):
        self.step = torch.zeros((), dtype=torch.int64)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step.copy_(state["step"])


def _manager(tmp_path: Path, model: nn.Module, **config) -> CheckpointManager:
    return CheckpointManager(
        CheckpointConfig(enable=True, interval=1, **config),
        dump_folder=str(tmp_path),
        states={"model": ModelState([model]), "train_state": _Progress()},
        device_type="cpu",
    )


def _saved(tmp_path: Path, steps: list[int], **config) -> tuple[nn.Module, Path]:
    """A model saved at ``steps`` (its weights are the step number), and the folder."""
    model = nn.Linear(4, 4)
    manager = _manager(tmp_path, model, **config)
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(step)
        manager.save(step)
    manager.close()
    return model, tmp_path / "checkpoint"


def _load(tmp_path: Path, **config) -> tuple[int, nn.Module]:
    model = nn.Linear(4, 4)
    manager = _manager(tmp_path, model, **config)
    try:
        return manager.load(), model
    finally:
        manager.close()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_same_size_corruption_is_caught_and_the_previous_checkpoint_used(tmp_path):
    _, folder = _saved(tmp_path, [1, 2])
    data = next((folder / "step-2").glob("*.distcp"))
    _flip_a_byte(data)
    assert "changed since it was saved" in verify(folder / "step-2")
    assert verify(folder / "step-2", checksums=False) is None  # sizes alone miss it
    step, model = _load(tmp_path)
    assert step == 1 and torch.all(model.weight == 1)


def test_every_checkpoint_damaged_is_refused_not_trained_over(tmp_path):
    _, folder = _saved(tmp_path, [1, 2])
    for step in (1, 2):
        (folder / f"step-{step}" / MANIFEST).unlink()
    with pytest.raises(ConfigError, match="every checkpoint in .* is damaged .step-1, step-2"):
        _load(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2"]


def test_a_step_this_run_did_not_write_is_moved_aside_not_overwritten(tmp_path):
    """Manifest-only damage: step-2 is skipped on load; saving step 2 again keeps the old
    folder (its data may be what someone needs) under another name."""
    _, folder = _saved(tmp_path, [1, 2])
    (folder / "step-2" / MANIFEST).unlink()
    old_data = {p.name: p.read_bytes() for p in (folder / "step-2").glob("*.distcp")}
    model = nn.Linear(4, 4)
    manager = _manager(tmp_path, model)
    assert manager.load() == 1
    manager.save(2)
    manager.close()
    aside = folder / "step-2.replaced"
    assert {p.name: p.read_bytes() for p in aside.glob("*.distcp")} == old_data
    assert verify(folder / "step-2") is None


def test_keep_latest_k_never_purges_a_damaged_checkpoint(tmp_path):
    _, folder = _saved(tmp_path, [1, 2])
    manifest = json.loads((folder / "step-1" / MANIFEST).read_text())
    manifest["files"][".metadata"] += 1  # a size that no longer matches
    (folder / "step-1" / MANIFEST).write_text(json.dumps(manifest))
    _saved(tmp_path, [3, 4], keep_latest_k=1)
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-4"]


def test_keep_latest_k_keeps_the_newest_full_checkpoint_beside_a_weights_only_last(tmp_path):
    """keep_latest_k 1 with a weights-only final save: step-2 (the last one with training
    state) stays, or nothing would resume the run."""
    model = nn.Linear(4, 4)
    manager = _manager(tmp_path, model, keep_latest_k=1, last_save_model_only=True)
    for step in (1, 2):
        manager.save(step)
    manager.save(3, last=True)
    manager.close()
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3"]
    assert _load(tmp_path, load_step=2)[0] == 2


def test_a_rewind_sets_newer_checkpoints_aside_and_its_restarts_continue_it(tmp_path):
    """--checkpoint.load_step 2 in a folder saved to step 6 (a rewind, e.g. before a loss
    spike): steps 4 and 6 are set aside before this run saves (kept, never resumed or purged),
    so keep_latest_k 1 purges only this run's; the same command again (a requeue) resumes this
    run's newest step, as a restart without the flag does."""
    _, folder = _saved(tmp_path, [2, 4, 6])
    model = nn.Linear(4, 4)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, interval=1, load_step=2, keep_latest_k=1),
        dump_folder=str(tmp_path),
        states={"model": ModelState([model]), "train_state": _Progress()},
        device_type="cpu",
        run_config="[checkpoint]\nload_step = 2\n",  # saved with each step, as the trainer's
    )
    assert manager.load() == 2 and torch.all(model.weight == 2)
    for step in (3, 4):
        with torch.no_grad():
            model.weight.fill_(100 + step)
        manager.save(step)
    manager.close()
    names = ["step-4", "step-4.replaced", "step-6.replaced"]
    assert sorted(p.name for p in folder.iterdir()) == names
    for again in ({"load_step": 2}, {}):
        step, model = _load(tmp_path, **again)
        assert step == 4 and torch.all(model.weight == 104), again
    assert sorted(p.name for p in folder.iterdir()) == names


def test_keep_every_keeps_milestones_beside_the_newest(tmp_path):
    """keep_latest_k 2 and keep_every 3 over steps 1-10: 3, 6 and 9 stay for good, 9 and 10
    as the newest two; the milestones are not counted among the newest."""
    _, folder = _saved(tmp_path, list(range(1, 11)), keep_latest_k=2, keep_every=3)
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-3", "step-6", "step-9"]


def test_a_full_disk_says_so_in_one_line_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CheckpointWriter, "write_data", full)
    model = nn.Linear(512, 512, bias=False)  # 1 MiB of float32 weights
    manager = _manager(tmp_path, model)
    with pytest.raises(ConfigError) as refused:
        manager.save(1)
    manager.close()
    message = str(refused.value)
    assert message.startswith("no space left on device saving checkpoint step-1 in ")
    assert "it needs about 1.0 MiB on this rank" in message and " are free" in message
    assert "no checkpoint is complete" in message
    assert not (tmp_path / "checkpoint" / "step-1.tmp").exists()


def test_a_bug_while_saving_keeps_its_traceback(tmp_path, monkeypatch):
    """Only the file system's refusals become one line; anything else is a bug to see."""

    def broken(self, *args, **kwargs):
        raise ValueError("a Stateful that cannot be written")

    monkeypatch.setattr(CheckpointWriter, "write_data", broken)
    manager = _manager(tmp_path, nn.Linear(4, 4))
    with pytest.raises(BaseException, match="a Stateful that cannot be written") as raised:
        manager.save(1)
    manager.close()
    assert not isinstance(raised.value, ConfigError)


def test_a_folder_that_cannot_be_made_at_a_save_says_so_in_one_line(tmp_path):
    """The folder was writable at the start (the launch checks it) and is not any more: here
    it became a file. One line naming the save and what is kept, not a traceback."""
    model = nn.Linear(4, 4)
    manager = _manager(tmp_path, model)
    manager.save(1)
    folder = tmp_path / "checkpoint"
    moved = tmp_path / "moved"
    folder.rename(moved)
    folder.write_text("")  # a file where the folder was
    with pytest.raises(ConfigError) as refused:
        manager.save(2)
    manager.close()
    assert str(refused.value).startswith(f"cannot save checkpoint step-2 in {folder}: ")
    assert "(no checkpoint is complete)" in str(refused.value)
    assert (moved / "step-1").is_dir()  # nothing saved was touched


@pytest.mark.parametrize("reader", ["validation_only", "load_only"])
def test_a_run_that_only_reads_leaves_a_live_runs_save_in_progress(tmp_path, reader):
    """A validation of saved weights (or ``load_only``) may run beside the training that
    saves into the folder: that run's ``step-N.tmp`` is not its to remove. A run that writes
    the folder removes what an earlier run left half-written."""
    _saved(tmp_path, [1])
    partial = tmp_path / "checkpoint" / "step-2.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"shard")
    CheckpointManager(
        CheckpointConfig(enable=True, load_only=reader == "load_only"),
        dump_folder=str(tmp_path),
        states={"model": ModelState([nn.Linear(4, 4)]), "train_state": _Progress()},
        device_type="cpu",
        writes=reader != "validation_only",
    ).close()
    assert (partial / "__0_0.distcp").read_bytes() == b"shard"
    _manager(tmp_path, nn.Linear(4, 4)).close()
    assert not partial.exists()


def test_a_seed_checkpoint_into_a_folder_of_later_steps_is_refused(tmp_path):
    """Runs resume the newest step, never a seed beside it; keep_latest_k would purge it."""
    _saved(tmp_path, [2])
    manager = _manager(tmp_path, nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="holds checkpoints up to step-2, which runs resume"):
        manager.save(0, model_only=True)
    manager.close()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]


def test_a_fork_of_a_step_in_its_own_checkpoint_folder_is_refused(tmp_path):
    """A fork (no_initial_load_model_only) whose --checkpoint.folder is the source's: it would
    resume the source's newest step (step-4) instead of the one named, and mix its checkpoints
    with the source's."""
    _, folder = _saved(tmp_path / "source", [2, 4])
    model = nn.Linear(4, 4)
    manager = _manager(
        tmp_path / "fork",
        model,
        folder=str(folder),
        initial_load_path=str(folder / "step-2"),
        initial_load_model_only=False,
    )
    with pytest.raises(ConfigError, match="inside this run's --checkpoint.folder"):
        manager.load()
    manager.close()
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4"]


def test_a_purge_cut_short_leaves_no_half_removed_step(tmp_path, monkeypatch):
    """keep_latest_k renames an old step before removing it: a kill in the middle leaves
    step-1.removing (never loaded), which the next run's start removes, not a step-1 missing
    some files that would be kept for good as damaged."""
    from torchtitan.components import checkpoint_folder

    def killed(path, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_folder, "shutil", SimpleNamespace(rmtree=killed))
    with pytest.raises(KeyboardInterrupt):
        _saved(tmp_path, [1, 2], keep_latest_k=1)
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-1.removing", "step-2"]
    monkeypatch.undo()
    step, model = _load(tmp_path)
    assert step == 2 and sorted(p.name for p in folder.iterdir()) == ["step-2"]


def test_a_rewind_to_a_step_that_is_not_there_sets_nothing_aside(tmp_path):
    """A mistyped or purged load_step is an error before anything moves: a plain restart
    still finds every step."""
    _, folder = _saved(tmp_path, [2, 4, 6])
    with pytest.raises(ConfigError, match="--checkpoint.load_step=3: "):
        _load(tmp_path, load_step=3)
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-4", "step-6"]


def test_a_rewound_runs_damaged_newest_step_falls_back_to_its_previous_one(tmp_path):
    _, folder = _saved(tmp_path, [2])
    model = nn.Linear(4, 4)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, interval=1, load_step=2),
        dump_folder=str(tmp_path),
        states={"model": ModelState([model]), "train_state": _Progress()},
        device_type="cpu",
        run_config="[checkpoint]\nload_step = 2\n",
    )
    assert manager.load() == 2
    for step in (3, 4):
        with torch.no_grad():
            model.weight.fill_(100 + step)
        manager.save(step)
    manager.close()
    (folder / "step-4" / MANIFEST).unlink()
    step, model = _load(tmp_path, load_step=2)
    assert step == 3 and torch.all(model.weight == 103)
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3", "step-4"]


def test_a_damaged_old_step_does_not_stop_a_weights_only_final_save(tmp_path):
    model, folder = _saved(tmp_path, [1, 2])
    (folder / "step-1" / ".metadata").unlink()
    manager = _manager(tmp_path, model, keep_latest_k=1, last_save_model_only=True)
    manager.save(3, last=True)
    manager.close()
    names = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert names == ["step-1", "step-2", "step-3"]  # damaged kept; the newest full one kept

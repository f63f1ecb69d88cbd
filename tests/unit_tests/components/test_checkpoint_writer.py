"""How checkpoints are staged and written: host buffers allocated ahead and reused, files
dropped from the page cache, a niced background write, and a warning when a save waits for the
previous one."""

import os
import threading
import time
import zlib

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from torchtitan.components import checkpoint
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpoint_files import CHECKSUM_SUFFIX
from torchtitan.components.checkpoint_states import ModelState
from torchtitan.components.checkpoint_writer import CheckpointWriter, stager_for
from torchtitan.components.optimizer import Optimizers
from torchtitan.config.job_config import Checkpoint as CheckpointConfig


def test_async_staging_reuses_its_host_buffers_and_copies_current_values():
    stager = stager_for("async", "cpu")
    weight = torch.arange(6, dtype=torch.float32)
    try:
        first = stager.stage({"w": weight})["w"]
        weight.add_(100)
        second = stager.stage({"w": weight})["w"]
    finally:
        stager.close()
    assert second.data_ptr() == first.data_ptr()  # no new allocation on the second save
    assert second.data_ptr() != weight.data_ptr()  # a copy: training may update the weights
    assert torch.equal(second, weight)


def test_pinned_mode_without_gpu_is_plain_async(monkeypatch):
    warnings = []
    monkeypatch.setattr(checkpoint.logger, "warning", warnings.append)
    stager = stager_for("async_with_pinned_mem", "cpu")
    stager.close()
    assert stager._config.use_pinned_memory is False
    assert stager._config.use_async_staging is False
    assert "needs a GPU" in warnings[0]
    assert stager_for("disabled", "cpu") is None


def _record_fadvise(monkeypatch) -> list[str]:
    dropped = []

    def fadvise(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_DONTNEED
        dropped.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return dropped


def test_every_written_file_leaves_the_page_cache(tmp_path, monkeypatch):
    dropped = _record_fadvise(monkeypatch)
    state = {"a": torch.randn(64, 64), "b": torch.randn(10)}
    dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path)), no_dist=True)
    written = sorted(p.name for p in tmp_path.iterdir() if p.suffix != CHECKSUM_SUFFIX)
    # DCP writes .metadata as .metadata.tmp and renames it once complete.
    assert sorted(name.removesuffix(".tmp") for name in dropped) == written and any(
        n.endswith(".distcp") for n in written
    )
    # Each data file leaves its CRC-32 beside it, taken before its pages were dropped.
    for data in tmp_path.glob("*.distcp"):
        sidecar = data.with_name(data.name + CHECKSUM_SUFFIX)
        assert int(sidecar.read_text()) == zlib.crc32(data.read_bytes())
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_only_the_background_write_is_niced(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "setpriority", lambda *args: calls.append(args[-1]))
    state = {"a": torch.randn(8)}
    dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path / "sync")), no_dist=True)
    assert calls == []
    dcp.save(
        state, storage_writer=CheckpointWriter(str(tmp_path / "bg"), background=True), no_dist=True
    )
    assert calls == [19]


def test_a_save_that_waits_for_the_previous_write_says_so(tmp_path, monkeypatch):
    write_data = CheckpointWriter.write_data

    def slow_write(self, *args, **kwargs):
        time.sleep(1.0)
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointWriter, "write_data", slow_write)
    warnings = []
    monkeypatch.setattr(checkpoint.logger, "warning", warnings.append)
    model = nn.Linear(4, 4)
    config = CheckpointConfig(enable=True, async_mode="async", interval=1)
    manager = CheckpointManager(
        config,
        dump_folder=str(tmp_path),
        states={"model": ModelState([model])},
        device_type="cpu",
    )
    try:
        manager.save(1)
        manager.save(2)  # step-1 is still being written
        manager.save(3, last=True)  # the final save always waits: no warning
    finally:
        manager.close()
    assert len(warnings) == 1, warnings
    assert "step-1 was still being written: step 2 waited" in warnings[0]
    assert "--checkpoint.interval" in warnings[0]
    assert [p.name for p in sorted((tmp_path / "checkpoint").iterdir())] == [
        "step-1",
        "step-2",
        "step-3",
    ]


def _async_manager_naming_stagers(tmp_path):
    """An async ``CheckpointManager`` of a small model and its AdamW, and the list of the
    threads that staged its state (appended to as they stage)."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = CheckpointConfig(enable=True, async_mode="async", interval=1)
    manager = CheckpointManager(
        config,
        dump_folder=str(tmp_path),
        states={"model": ModelState([model]), "optimizer": Optimizers([model], [optimizer])},
        device_type="cpu",
    )
    callers = []
    stage = manager.background.stager.stage
    manager.background.stager.stage = lambda state: (
        callers.append(threading.current_thread().name) or stage(state)
    )
    return model, optimizer, manager, callers


def test_staging_buffers_are_allocated_in_the_background_after_the_first_step(tmp_path):
    model, optimizer, manager, callers = _async_manager_naming_stagers(tmp_path)
    try:
        manager.poll()  # no optimizer state yet: DCP would have to step the optimizer to make it
        assert callers == [] and not optimizer.state
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        manager.poll()
        manager.background.join_prestage()
        assert callers == ["checkpoint-prestage"]
        manager.poll()  # once per run
        with torch.no_grad():
            model.weight.add_(1.0)  # the save must write these values, not the prestaged ones
        manager.save(1)
        manager.finish_pending()
        assert callers == ["checkpoint-prestage", threading.current_thread().name]
    finally:
        manager.close()
    loaded = {"model": {"weight": torch.zeros(4, 4), "bias": torch.zeros(4)}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "checkpoint/step-1"), no_dist=True)
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())


def test_no_staging_ahead_once_a_save_has_started(tmp_path):
    """A first save before any optimizer step (skipped steps at the start) makes the
    optimizer's state (DCP steps it at lr 0): the staging buffers are allocated by that save,
    and copying a later step into them while it writes would change what it writes."""
    model, optimizer, manager, callers = _async_manager_naming_stagers(tmp_path)
    try:
        manager.save(1)
        assert optimizer.state  # made by the save
        manager.poll()
        manager.background.join_prestage()
        manager.finish_pending()
        assert callers == [threading.current_thread().name]  # the save's own staging only
    finally:
        manager.close()


def test_a_save_now_is_written_before_it_returns_in_async_mode(tmp_path):
    """A preemption's save (``now``) does not go to the background, where it would be written
    at the lowest priority while the job's kill comes closer."""
    model = nn.Linear(4, 4)
    config = CheckpointConfig(enable=True, async_mode="async", interval=1)
    manager = CheckpointManager(
        config, dump_folder=str(tmp_path), states={"model": ModelState([model])}, device_type="cpu"
    )
    try:
        manager.save(1, now=True)
        assert manager.background.pending is None
        assert (tmp_path / "checkpoint/step-1").is_dir()
    finally:
        manager.close()

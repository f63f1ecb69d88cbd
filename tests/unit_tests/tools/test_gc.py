"""Scheduled garbage collection, and ``--training.gc_debug``'s report of tensors in cycles."""

import gc
import logging
import weakref

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.tools.gc import GC_DEBUG_FOLDER, gc_every, report_tensor_cycles


class _Node:
    pass


def _cycle_holding(tensor: torch.Tensor) -> weakref.ref:
    """A two-object reference cycle that alone keeps ``tensor`` alive; its weak reference."""
    a, b = _Node(), _Node()
    a.other, b.other, b.state = b, a, {"tensor": tensor}
    return weakref.ref(tensor)


def test_scheduled_collection_leaves_cycles_until_its_step():
    enabled = gc.isenabled()
    with gc_every(3) as tick:
        assert not gc.isenabled()
        alive = _cycle_holding(torch.zeros(4))
        tick(2)
        assert alive() is not None  # not a collection step
        tick(3)
        assert alive() is None
    assert gc.isenabled() == enabled


def test_a_cycle_holding_tensors_is_named_once_with_its_graph_and_freed(tmp_path, caplog):
    # Warnings only: the mode's start-up line is INFO (shown where init_logger ran before).
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        with gc_every(50, debug=True, dump_folder=str(tmp_path), rank=1) as tick:
            tick(1)  # nothing made yet: nothing said
            assert caplog.records == []
            alive = _cycle_holding(torch.zeros(256, 1024))  # 1 MiB
            small = _cycle_holding(torch.ones(3, dtype=torch.bfloat16))
            tick(2)  # collects every step, whatever gc_freq says
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    listing = tmp_path / GC_DEBUG_FOLDER / "rank1_step2.txt"
    big, little = "float32[256, 1024] on cpu", "bfloat16[3] on cpu"
    holders = "_Node.other -> _Node.other -> _Node.state -> dict['tensor']"
    assert lines[0] == (
        f"--training.gc_debug: 2 tensor(s) holding 1.0 MiB ({big}, {little}) in reference "
        "cycles that only the garbage collector frees (found at the start of step 2: made in "
        f"step 1 or before); the largest is {holders} ({big}); each one's holders: {listing}"
    )
    assert listing.read_text().splitlines()[1:] == [f"{holders} ({big})", f"{holders} ({little})"]
    assert alive() is None and small() is None  # freed after the look, as without the mode
    assert gc.garbage == [] and gc.get_debug() == 0


def test_cycles_without_tensors_and_tensors_without_cycles_are_not_reported(tmp_path):
    gc.collect()
    kept = torch.zeros(8)  # reachable: not garbage
    gone = _Node()
    a = _Node()
    a.me, a.proxy = a, weakref.proxy(gone)  # a weak proxy to a dead object raises on a look
    del a, gone
    assert report_tensor_cycles(1, dump_folder=str(tmp_path), rank=0) == 0
    assert not (tmp_path / GC_DEBUG_FOLDER).exists() and kept.sum() == 0


def test_a_dtensor_in_a_cycle_counts_its_local_tensor_and_meta_tensors_none(tmp_path):
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        _cycle_holding(DTensor.from_local(torch.ones(4, 4), mesh, [Replicate()], run_check=False))
        _cycle_holding(torch.empty(1000, device="meta"))
        assert report_tensor_cycles(3, dump_folder=str(tmp_path), rank=0) == 1
        listing = (tmp_path / GC_DEBUG_FOLDER / "rank0_step3.txt").read_text().splitlines()
        assert listing[1] == (
            "_Node.other -> _Node.other -> _Node.state -> dict['tensor'] -> "
            "DTensor._local_tensor (float32[4, 4] on cpu)"
        )
    finally:
        torch.distributed.destroy_process_group()


def test_the_last_steps_cycles_are_reported_when_training_ends(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        with gc_every(50, debug=True, dump_folder=str(tmp_path), rank=0) as tick:
            tick(1)
            tick(2)
            alive = _cycle_holding(torch.zeros(2, 2))  # made in step 2, the last
    [line] = [r.getMessage() for r in caplog.records]
    assert "1 tensor(s) holding 16 B (float32[2, 2] on cpu)" in line
    assert "found at the end of step 2: made in step 2 or before" in line
    assert (tmp_path / GC_DEBUG_FOLDER / "rank0_step2_end.txt").is_file() and alive() is None

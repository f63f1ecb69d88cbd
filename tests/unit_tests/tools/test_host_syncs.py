"""The host-sync census: which ops it counts, and the reads a training step makes."""

import collections
import re
import threading

import pytest
import torch

from torchtitan.config.manager import parse_args
from torchtitan.tools.host_syncs import HostSyncCensus
from torchtitan.trainer import Trainer


def _reasons(fn) -> list[str]:
    with HostSyncCensus(device_only=False) as census:
        fn()
    return sorted(reason.split(":")[0].split(" ")[0] for (_, reason) in census.counts)


def test_the_census_counts_the_reads_that_wait_for_a_gpu_and_nothing_else():
    t = torch.arange(6)
    counted = {
        "item": lambda: t.sum().item(),
        "bool": lambda: bool((t > 2).any()),
        "tolist": lambda: t.tolist(),
        "cpu": lambda: t.cpu(),
        "nonzero": lambda: t.nonzero(),
        "bincount": lambda: torch.bincount(t, minlength=8),
        "mask": lambda: t[t > 2],
        "mask_put": lambda: t.clone().__setitem__(t > 3, torch.tensor([7, 8])),
        "repeat": lambda: torch.repeat_interleave(t, t),
        "histc": lambda: torch.histc(t.float(), bins=3),
        "mask_and_index": lambda: (
            t.view(2, 3).clone().__setitem__((torch.tensor([True, False]), torch.tensor([1])), 0)
        ),  # not masked_fill_'s one mask: nonzero
        "unique": lambda: torch.unique(t),
    }
    for name, fn in counted.items():
        assert len(_reasons(fn)) == 1, name
    free = {
        "scatter_add": lambda: t.new_zeros(8).scatter_add_(0, t, torch.ones_like(t)),
        "repeat_sized": lambda: torch.repeat_interleave(t, t, output_size=15),
        "histc_ranged": lambda: torch.histc(t.float(), bins=3, min=0, max=6),
        "index": lambda: t[torch.tensor([0, 2])],
        "mask_fill": lambda: t.clone().__setitem__(t > 4, 1),  # ATen's masked_fill_ path
        "host_copy": lambda: t.to("cpu").clone().copy_(t),
        "arithmetic": lambda: (t * 2).cumsum(0).argsort(stable=True),
    }
    for name, fn in free.items():
        assert _reasons(fn) == [], name


def test_on_a_gpu_only_device_tensors_count_and_the_patches_come_off():
    original = torch.Tensor.tolist
    device = torch.empty(3, device="meta")  # a tensor not on the host, without a GPU
    with HostSyncCensus(device_only=True) as census:
        torch.arange(3).sum().item()
        torch.arange(3).tolist()
        torch.arange(3).to("meta", non_blocking=True)
        torch.arange(3).to("meta")  # blocking: waits for the device's queue
        with pytest.raises(NotImplementedError):  # counted before the copy fails
            device.to("cpu")
    assert sorted(reason for _, reason in census.counts) == [
        "a blocking copy to the device (non_blocking=False)",
        "a copy to the host",
    ]
    assert torch.Tensor.tolist is original


def test_each_thread_counts_its_own_reads_and_the_patches_come_off_after_the_last():
    """Pipeline ranks simulated as threads each open a census; they close in any order."""
    original, entered, finish_first = torch.Tensor.tolist, threading.Barrier(2), threading.Event()
    counts = {}

    def rank(name: str, reads: int, first: bool) -> None:
        with HostSyncCensus(device_only=False) as census:
            entered.wait()
            for _ in range(reads):
                torch.arange(3).tolist()
            if not first:
                finish_first.wait()
        if first:
            finish_first.set()
        counts[name] = census.total

    threads = [
        threading.Thread(target=rank, args=("a", 2, False)),
        threading.Thread(target=rank, args=("b", 5, True)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts == {"a": 2, "b": 5}
    assert torch.Tensor.tolist is original


def _step_sites(tmp_path, *flags: str) -> dict[str, int]:
    """How often each site (its functions, innermost first) read in step 2, in one process."""
    args = [
        "--training.seq_len", "64", "--training.steps", "3", "--metrics.log_freq", "10",
        "--metrics.no_report", "--debug.host_sync_step", "2",
        "--job.dump_folder", str(tmp_path), *flags,
    ]  # fmt: skip
    trainer = Trainer(parse_args(args, console_outputs=False))
    trainer.train()
    trainer.close()
    text = (tmp_path / "host_syncs" / "rank0_step2.txt").read_text()
    assert re.search(r"step 2's training step \(not a logging step\), rank 0: \d+ at", text)
    sites = collections.Counter()
    for line in text.splitlines()[1::2]:
        sites[" <- ".join(re.findall(r" in (\w+)", line))] += int(line.split("x")[0])
    return dict(sites)


def test_a_dense_step_reads_the_token_count_and_the_norms_finiteness_only(tmp_path):
    # The token count is summed on the batch's host copy (no GPU wait); the finiteness of
    # the gradient norm decides the optimizer step on every rank alike.
    assert _step_sites(tmp_path) == {
        "dist_reduce <- train_step": 1,
        "should_step <- train_step": 1,
    }


@pytest.mark.parametrize(
    "module, config, moe_layers",
    [("qwen3", "qwen3_moe_debugmodel", 4), ("deepseek_v3", "deepseek_v3_debugmodel", 3)],
)
def test_a_moe_step_reads_only_each_layers_padded_expert_rows(tmp_path, module, config, moe_layers):
    # Counting the routings per expert reads nothing on the host (bincount did: twice per
    # layer on CUDA); the grouped GEMM reads its padded row total (sizing its buffer for the
    # most padding instead measured no faster on an H100).
    sites = _step_sites(tmp_path, "--module", module, "--config", config)
    assert sites == {
        "dist_reduce <- train_step": 1,
        "should_step <- train_step": 1,
        "_grouped_mm_experts <- forward": moe_layers,
    }


def test_spike_judging_reads_the_global_loss_and_the_norm(tmp_path):
    # --training.spike_sigma: the loss summed over the ranks and the norm's value, every step.
    sites = _step_sites(tmp_path, "--training.spike_sigma", "6", "--training.spike_window", "2")
    assert sites == {
        "dist_reduce <- train_step": 1,
        "should_step <- train_step": 1,
        "dist_reduce <- global_loss": 1,
        "judge <- should_step": 1,
    }

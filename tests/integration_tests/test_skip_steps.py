"""``--training.skip_steps``: a skipped step reads its batches and drops them. Over the skipped
steps the weights and optimizer state stay bitwise as they were, while the data position and
the LR schedule reach exactly those of the run that trained them; a run resumed before the
range skips it again and trains its later steps bitwise as the uninterrupted one."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from launch import SMALL, records, run_train
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from torchtitan.tools.report import load_run, summary
from torchtitan.tools.watchdog import StepWatchdog
from torchtitan.train import main

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:'set_vital'"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

RUN = [
    *SMALL, "--debug.deterministic", "--training.steps", "6", "--lr_scheduler.warmup_steps",
    "2", "--checkpoint.enable", "--checkpoint.interval", "2", "--training.local_batch_size", "4",
    "--training.global_batch_size", "8",
]  # fmt: skip
SKIP = ["--training.skip_steps", "3-4"]


def _losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(dump) if "loss" in r}


def _saved(dump: Path, step: int, tmp_path: Path) -> dict:
    out = tmp_path / f"{dump.name}-{step}.pt"
    dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", out)
    return torch.load(out, weights_only=False)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def test_skipped_steps_read_their_data_and_train_nothing(tmp_path: Path, monkeypatch) -> None:
    plain, skipping = tmp_path / "plain", tmp_path / "skipping"
    assert main([*RUN, "--job.dump_folder", str(plain)]) == 0
    assert main([*RUN, *SKIP, "--job.dump_folder", str(skipping)]) == 0
    want, got = _losses(plain), _losses(skipping)
    assert sorted(got) == [1, 2, 5, 6]
    assert [got[s] for s in (1, 2)] == [want[s] for s in (1, 2)]
    assert got[5] != want[5]  # the step-2 weights on step 5's batches

    before, after = _saved(skipping, 2, tmp_path), _saved(skipping, 4, tmp_path)
    trained = _saved(plain, 4, tmp_path)
    assert _equal(after["model"], before["model"])
    # Adam's moments and step counts; its param groups carry the LR, which moves on.
    moments = [
        {k: v for k, v in s["optimizer"].items() if k.startswith("state.")} for s in (before, after)
    ]
    assert _equal(*moments) and len(moments[0]) > 0
    assert not _equal(trained["model"], before["model"])
    for state in ("dataloader", "lr_scheduler"):
        assert _equal(after[state], trained[state]), state
        assert not _equal(after[state], before[state]), state
    assert after["train_state"]["step"] == 4
    records_lr = {r["step"]: r["lr"] for r in records(skipping)}
    assert records_lr[5] == {r["step"]: r["lr"] for r in records(plain)}[5]

    # Resumed from step 2, the run skips steps 3-4 again: steps 5-6 bitwise. The hang
    # watchdog gives the first step it trains (5, with the first collectives) the start-up
    # timeout, not the skipped steps alone.
    armed = {}
    start = StepWatchdog.start
    monkeypatch.setattr(
        StepWatchdog,
        "start",
        lambda self, step, t: (armed.setdefault(step, t), start(self, step, t)),
    )
    resumed = tmp_path / "resumed"
    shutil.copytree(skipping / "checkpoint/step-2", resumed / "checkpoint/step-2")
    timeouts = ["--comm.init_timeout_seconds", "301", "--comm.train_timeout_seconds", "99"]
    assert main([*RUN, *SKIP, *timeouts, "--job.dump_folder", str(resumed)]) == 0
    assert armed == {3: 301, 4: 301, 5: 301, 6: 99}
    again = _losses(resumed)
    assert sorted(again) == [5, 6] and [again[s] for s in (5, 6)] == [got[5], got[6]]
    assert "skips        the data of steps 3-4 (--training.skip_steps)" in summary(
        load_run(resumed)
    )


def _events(dump: Path, kind: str) -> list[dict]:
    return [e for e in load_run(dump).events if e.get("event") == kind]


def test_a_spike_skips_its_update_as_skipping_its_data_would(tmp_path: Path) -> None:
    """``--training.spike_sigma``, tight enough here (0.5 over a window of 2) that some steps
    spike: their updates are skipped, so every later step trains bitwise as in a run that
    skipped those steps' data (``--training.skip_steps``). The window is checkpointed: it holds
    the last steps' logged losses and norms, and a resumed run judges as the uninterrupted one."""
    steps = ["--training.steps", "8"]
    spikes = ["--training.spike_sigma", "0.5", "--training.spike_window", "2"]
    spiky = tmp_path / "spiky"
    assert main([*RUN, *steps, *spikes, "--job.dump_folder", str(spiky)]) == 0
    flagged = [e["step"] for e in _events(spiky, "spike")]
    got = _losses(spiky)
    assert flagged and min(flagged) > 2  # the window fills first
    assert set(range(min(flagged), 9)) - set(flagged)  # and steps train after a spike
    assert 7 in flagged  # (this deterministic run's: what the resume at step 6 judges)
    assert set(got) == set(range(1, 9))  # a spiking step is logged (its data was trained on)
    counts = {r["step"]: r["spike_skipped_steps"] for r in records(spiky) if "loss" in r}
    assert counts[8] == len(flagged)
    assert f"{len(flagged)} update(s) skipped, steps" in summary(load_run(spiky))

    skipping = tmp_path / "skipping"
    skip = ["--training.skip_steps", *map(str, flagged)]
    assert main([*RUN, *steps, *skip, "--job.dump_folder", str(skipping)]) == 0
    want = _losses(skipping)
    assert sorted(want) == [s for s in range(1, 9) if s not in flagged]
    assert {s: got[s] for s in want} == want

    # The step-6 checkpoint's window: steps 5 and 6's global losses and norms, as logged; a
    # run resumed there judges step 7 by them (with an empty window it could not).
    logged = {r["step"]: r for r in records(spiky) if "loss" in r}
    window = json.loads(_saved(spiky, 6, tmp_path)["spikes"]["window"])
    assert window["loss"] == [logged[s]["loss"] for s in (5, 6)]
    assert window["gradient norm"] == [logged[s]["grad_norm"] for s in (5, 6)]
    assert window["skipped"] == len([s for s in flagged if s <= 6])
    resumed = tmp_path / "resumed"
    shutil.copytree(spiky / "checkpoint/step-6", resumed / "checkpoint/step-6")
    assert main([*RUN, *steps, *spikes, "--job.dump_folder", str(resumed)]) == 0
    assert [e["step"] for e in _events(resumed, "spike")] == [s for s in flagged if s > 6]
    assert _losses(resumed) == {s: got[s] for s in (7, 8)}
    assert records(resumed)[-1]["spike_skipped_steps"] == len(flagged)

    # A checkpoint written without the window resumes with one (empty, refilling).
    turned_on = tmp_path / "turned_on"
    shutil.copytree(skipping / "checkpoint/step-4", turned_on / "checkpoint/step-4")
    assert main([*RUN, *spikes, "--job.dump_folder", str(turned_on)]) == 0
    assert sorted(_losses(turned_on)) == [5, 6]


def test_fsdp_ranks_agree_on_the_spikes_of_one_process(tmp_path: Path) -> None:
    """FSDP 2 (the batch split over the ranks, by row) judges the same steps spikes as one
    process and trains alike; each rank's verdict is the job's (agreed on a host flag)."""
    flags = [
        *RUN, "--training.steps", "8", "--training.spike_sigma", "0.5", "--training.spike_window",
        "2", "--training.data_sharding", "by_row",
    ]  # fmt: skip
    one = tmp_path / "one"
    assert main([*flags, "--job.dump_folder", str(one)]) == 0
    fsdp = tmp_path / "fsdp"
    result = run_train(fsdp, *flags[len(SMALL) :], ngpu=2)
    assert result.returncode == 0, result.stderr[-3000:]
    flagged = [e["step"] for e in _events(one, "spike")]
    assert flagged and [e["step"] for e in _events(fsdp, "spike")] == flagged
    want, got = _losses(one), _losses(fsdp)
    assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-5)


def test_a_moe_models_spikes_skip_its_routing_bias_updates_too(tmp_path: Path) -> None:
    """DeepSeek-V3's debug model (routing biases moved after each update by the step's
    counts): a skipped spike's routings move no bias, so every later step trains bitwise as
    in a run that skipped those steps' data, and the final biases are the same."""
    moe = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel"]
    flags = [*moe, *RUN, "--training.steps", "8", "--checkpoint.interval", "8"]
    spiky, skipping = tmp_path / "spiky", tmp_path / "skipping"
    # A window of 3: with 2, torch 2.11's numbers flag every step from the 3rd.
    spikes = ["--training.spike_sigma", "0.5", "--training.spike_window", "3"]
    assert main([*flags, *spikes, "--job.dump_folder", str(spiky)]) == 0
    flagged = [e["step"] for e in _events(spiky, "spike")]
    assert flagged and set(range(min(flagged), 9)) - set(flagged)  # steps train after a spike
    skip = ["--training.skip_steps", *map(str, flagged)]
    assert main([*flags, *skip, "--job.dump_folder", str(skipping)]) == 0
    got, want = _losses(spiky), _losses(skipping)
    assert {s: got[s] for s in want} == want
    biases = [
        {k: v for k, v in _saved(d, 8, tmp_path)["model"].items() if k.endswith("expert_bias")}
        for d in (spiky, skipping)
    ]
    assert biases[0] and _equal(*biases) and any(b.abs().sum() > 0 for b in biases[0].values())

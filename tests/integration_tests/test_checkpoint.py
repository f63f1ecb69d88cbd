"""Checkpoints lose nothing: exact resume (1 process, FSDP, sync and async), torn checkpoints,
resharding, seed checkpoints, and the flags that shape what is saved/loaded. (A killed rank's
job resuming from its last complete checkpoint: ``test_fault_tolerance.py``.)"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from torchtitan.components import checkpoint_async, checkpoint_writer
from torchtitan.components.checkpoint import complete_checkpoints
from torchtitan.train import main

REPO = Path(__file__).resolve().parents[2]
# A constant LR after warm-up keeps the schedule of a 10-step run equal to the first 10 steps of
# a 20-step one, so "train 10, stop, resume to 20" must reproduce "train 20".
BASE = [
    "--training.seq_len", "64", "--debug.seed", "0", "--debug.deterministic",
    "--metrics.log_freq", "1", "--metrics.no_report", "--lr_scheduler.warmup_steps", "2",
    "--lr_scheduler.decay_type", "constant", "--checkpoint.enable",
    "--checkpoint.interval", "5", "--checkpoint.no_last_save_model_only",
]  # fmt: skip

pytestmark = pytest.mark.integration


def _losses(dump: Path, name: str = "metrics.jsonl") -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (dump / name).read_text().splitlines())}


def _train(dump: Path, *flags: str) -> int:
    return main([*BASE, "--job.dump_folder", str(dump), *flags])


def _run_train(dump: Path, *flags: str, ngpu: int = 2) -> subprocess.CompletedProcess:
    """``./run_train.sh`` into ``dump``, run once more from the same files if a rank died of a
    signal: torch 2.13's CPU build aborts a rank inside C++ now and then under load (SIGABRT
    at step 2 of a CP 2 run in one CI, not reproduced in 8 runs alone), as the numerics
    harness's launches do. A crash of ours that came only now and then would pass here too;
    the retry prints the first attempt's stderr, so CI logs show it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    before = dump.with_name(dump.name + ".before")  # what the retry starts from

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            ["./run_train.sh", *BASE, "--job.dump_folder", str(dump), *flags],
            cwd=REPO,
            env=env | {"NGPU": str(ngpu), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )

    try:
        if dump.exists():
            shutil.copytree(dump, before, dirs_exist_ok=True)
        result = run()
        if result.returncode != 0 and "was killed by SIG" in result.stderr:
            print(f"a rank crashed; running again from the same files:\n{result.stderr[-3000:]}")
            shutil.rmtree(dump, ignore_errors=True)
            if before.exists():
                shutil.copytree(before, dump)
            result = run()
    finally:
        shutil.rmtree(before, ignore_errors=True)
    return result


def _steps(dump: Path) -> list[str]:
    return [p.name for p in complete_checkpoints(dump / "checkpoint")]


def _copy_step(source: Path, step: int, dump: Path) -> None:
    """Put ``source``'s ``step-N`` checkpoint into ``dump``'s checkpoint folder."""
    name = f"step-{step}"
    shutil.copytree(source / "checkpoint" / name, dump / "checkpoint" / name)


# ---- one process ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("uninterrupted")
    assert _train(dump, "--training.steps", "20") == 0
    return dump


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_resume_is_bitwise_exact_in_one_process(tmp_path, uninterrupted, async_mode):
    mode = ["--checkpoint.async_mode", async_mode]
    assert _train(tmp_path, "--training.steps", "10", *mode) == 0
    assert _steps(tmp_path) == ["step-5", "step-10"]
    # step-5 was written by the mode under test (the final step-10 save is always synchronous).
    assert _train(tmp_path, "--training.steps", "20", "--checkpoint.load_step", "5", *mode) == 0
    want, got = _losses(uninterrupted), _losses(tmp_path)
    assert [got[s] for s in range(6, 21)] == [want[s] for s in range(6, 21)]


def test_stochastic_rounding_resumes_bitwise(tmp_path):
    """--optimizer.stochastic_rounding draws its bits from the step: a run resumed at step 5
    rounds steps 6-8 as the uninterrupted run did."""
    rounded = ["--training.steps", "8", "--training.dtype", "bfloat16"]
    rounded += ["--optimizer.stochastic_rounding"]
    assert _train(tmp_path / "whole", *rounded) == 0
    _copy_step(tmp_path / "whole", 5, tmp_path / "resumed")
    assert _train(tmp_path / "resumed", *rounded) == 0
    want, got = _losses(tmp_path / "whole"), _losses(tmp_path / "resumed")
    assert sorted(got) == [6, 7, 8] and [got[s] for s in got] == [want[s] for s in got]


def test_bf16_resumes_bitwise_and_takes_a_float32_runs_checkpoint(tmp_path, uninterrupted):
    """--training.dtype bfloat16 saves its weights and AdamW's moments in bf16 and resumes
    exactly; a float32 run's checkpoint resumes in bf16, cast on load."""
    from torchtitan.components.checkpoint_files import saved_tensor_metadata

    bf16 = ["--training.dtype", "bfloat16"]
    assert _train(tmp_path / "whole", "--training.steps", "8", *bf16) == 0
    saved = saved_tensor_metadata(tmp_path / "whole/checkpoint/step-5")
    floats = {
        k: m.properties.dtype
        for k, m in saved.items()
        if m.properties.dtype.is_floating_point and not k.endswith(".step")  # Adam's count
    }
    moments = [k for k in floats if k.endswith(".exp_avg")]
    assert moments and set(floats.values()) == {torch.bfloat16}, floats
    _copy_step(tmp_path / "whole", 5, tmp_path / "resumed")
    assert _train(tmp_path / "resumed", "--training.steps", "8", *bf16) == 0
    want, got = _losses(tmp_path / "whole"), _losses(tmp_path / "resumed")
    assert sorted(got) == [6, 7, 8] and [got[s] for s in got] == [want[s] for s in got]
    # A float32 run's weights and AdamW moments, rounded: its next steps within bf16's
    # rounding of float32's, closer than without the moments (Adam restarting).
    want = _losses(uninterrupted)
    off = {}
    for name, extra in (
        ("cast", []),
        ("fresh", ["--checkpoint.exclude_from_loading", "optimizer"]),
    ):
        _copy_step(uninterrupted, 5, tmp_path / name)
        assert _train(tmp_path / name, "--training.steps", "8", *bf16, *extra) == 0
        off[name] = [abs(_losses(tmp_path / name)[s] - want[s]) for s in (6, 7, 8)]
    assert max(off["cast"]) < 1e-2 and max(off["fresh"][1:]) > 3 * max(off["cast"][1:])


def test_torn_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, uninterrupted, capfd):
    assert _train(tmp_path, "--training.steps", "10") == 0
    shard = next((tmp_path / "checkpoint/step-10").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    assert _train(tmp_path, "--training.steps", "20") == 0
    err = capfd.readouterr().err
    assert "Skipping checkpoint" in err and "truncated" in err
    assert "Loading checkpoint" in err and "step-5 " in err
    # Resumed from step 5: steps 6..20 retrained, and identical to the uninterrupted run.
    want, got = _losses(uninterrupted), _losses(tmp_path)
    assert [got[s] for s in range(6, 21)] == [want[s] for s in range(6, 21)]


def test_explicit_load_step_that_is_missing_or_torn_is_an_error(tmp_path, capfd):
    assert _train(tmp_path, "--training.steps", "5") == 0
    assert _train(tmp_path, "--training.steps", "10", "--checkpoint.load_step", "7") == 2
    assert "--checkpoint.load_step=7" in capfd.readouterr().err
    (tmp_path / "checkpoint/step-5/manifest.json").unlink()
    assert _train(tmp_path, "--training.steps", "10", "--checkpoint.load_step", "5") == 2
    assert "incomplete checkpoint" in capfd.readouterr().err


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path, uninterrupted, capfd):
    _copy_step(uninterrupted, 5, tmp_path)
    assert (tmp_path / "checkpoint/step-5/config.toml").is_file()  # the writer's config
    (tmp_path / "config.toml").write_text("the run's own record")
    capfd.readouterr()
    assert _train(tmp_path, "--training.steps", "6", "--model.flavor", "debug_100m") == 2
    # The refused run leaves the folder's record of the run that saved it as it was.
    assert (tmp_path / "config.toml").read_text() == "the run's own record"
    errors = [line for line in capfd.readouterr().err.splitlines() if "does not fit" in line]
    assert len(errors) == 1, errors
    assert "layers.0.attention.wk.weight is [128, 256] there and [256, 768] here" in errors[0]
    assert "saved with --model.flavor debugmodel (this run: debug_100m)" in errors[0]


def test_initial_load_path_gives_way_to_the_folder_s_own_checkpoints(
    tmp_path, uninterrupted, capfd
):
    _copy_step(uninterrupted, 5, tmp_path)
    other = uninterrupted / "checkpoint" / "step-10"
    assert (
        _train(tmp_path, "--training.steps", "6", "--checkpoint.initial_load_path", str(other)) == 0
    )
    assert f"--checkpoint.initial_load_path {other} is not used" in capfd.readouterr().err
    assert _losses(tmp_path)[6] == _losses(uninterrupted)[6]  # resumed from the folder's step 5


def test_a_run_forks_another_at_its_step_and_goes_on_exactly(tmp_path, uninterrupted, capfd):
    """--checkpoint.no_initial_load_model_only: everything of another run's step-10 (weights,
    optimizer, schedule, data position, step) is read, here from a renamed copy, so steps
    11-20 in a new folder are the other run's; the source is left as it was, an earlier run's
    records in the folder are set aside, and a resume reads the run's own folder."""
    source = tmp_path / "copies" / "base-at-10"
    shutil.copytree(uninterrupted / "checkpoint" / "step-10", source)
    before = {p: p.stat().st_mtime_ns for p in source.iterdir()}
    dump = tmp_path / "fork"
    dump.mkdir()
    (dump / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # an earlier run's
    fork = [
        "--checkpoint.initial_load_path",
        str(source),
        "--checkpoint.no_initial_load_model_only",
    ]
    assert _train(dump, "--training.steps", "15", *fork) == 0
    assert f"Forked {source}: this run goes on from step 10" in capfd.readouterr().err
    assert _train(dump, "--training.steps", "20", *fork) == 0  # resumes its own step-15
    assert f"--checkpoint.initial_load_path {source} is not used" in capfd.readouterr().err
    want, got = _losses(uninterrupted), _losses(dump)
    assert sorted(got) == list(range(11, 21))
    assert [got[s] for s in range(11, 21)] == [want[s] for s in range(11, 21)]
    assert _steps(dump) == ["step-15", "step-20"]
    assert {p: p.stat().st_mtime_ns for p in source.iterdir()} == before
    (earlier,) = (dump / "earlier_runs").iterdir()
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'

    # Refused in one line: weights alone, and a step inside this run's own dump folder (whose
    # records, the source run's, stay where they are).
    seed = tmp_path / "seed"
    assert _train(seed, "--checkpoint.create_seed_checkpoint") == 0
    off = "--checkpoint.no_initial_load_model_only"
    seed_step = str(seed / "checkpoint" / "step-0")
    capfd.readouterr()
    assert _train(tmp_path / "weights", "--checkpoint.initial_load_path", seed_step, off) == 2
    assert "it holds weights only (a seed checkpoint or a model-only save); drop " in (
        capfd.readouterr().err
    )
    own = ["--checkpoint.initial_load_path", str(dump / "checkpoint" / "step-15")]
    assert _train(dump, "--checkpoint.folder", "branch", *own, off) == 2
    assert "that checkpoint is inside this run's --job.dump_folder" in capfd.readouterr().err
    assert sorted(_losses(dump)) == list(range(11, 21))


def test_an_interrupted_save_is_never_loaded(tmp_path, capfd):
    assert _train(tmp_path, "--training.steps", "5") == 0
    (tmp_path / "checkpoint/step-5").rename(tmp_path / "checkpoint/step-5.tmp")
    assert _train(tmp_path, "--training.steps", "1", "--checkpoint.interval", "100") == 0
    err = capfd.readouterr().err
    assert "Removing incomplete checkpoint" in err and "No checkpoint" in err


def test_keep_latest_k_load_only_and_export_dtype(tmp_path, capfd):
    assert _train(tmp_path, "--training.steps", "20", "--checkpoint.keep_latest_k", "2") == 0
    assert _steps(tmp_path) == ["step-15", "step-20"]
    # load_only: resumes but never writes.
    assert _train(tmp_path, "--training.steps", "25", "--checkpoint.load_only") == 0
    assert _steps(tmp_path) == ["step-15", "step-20"]
    assert min(_losses(tmp_path)) == 1  # the metrics file of the first run
    # The last save can keep only the weights, in another dtype.
    export = tmp_path / "export"
    assert _train(
        export, "--training.steps", "2", "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype", "bfloat16",
    ) == 0  # fmt: skip
    metadata = FileSystemReader(str(export / "checkpoint/step-2")).read_metadata()
    keys = metadata.state_dict_metadata
    assert all(k.startswith("model.") for k in keys)
    assert keys["model.tok_embeddings.weight"].properties.dtype == torch.bfloat16
    # Weights alone are no place to resume from: one line says what to do instead.
    capfd.readouterr()
    assert _train(export, "--training.steps", "4") == 2
    error = capfd.readouterr().err
    assert "holds only model weights" in error
    assert f"--checkpoint.initial_load_path {export / 'checkpoint/step-2'}" in error


def test_exclude_dataloader_restarts_the_data(tmp_path, uninterrupted):
    assert _train(tmp_path, "--training.steps", "10") == 0
    assert (
        _train(
            tmp_path, "--training.steps", "11", "--checkpoint.exclude_from_loading", "dataloader"
        )
        == 0
    )
    # Same weights as the uninterrupted run at step 10, but step 11 reads the first batch again.
    assert _losses(tmp_path)[11] != _losses(uninterrupted)[11]


def test_param_groups_added_on_resume_apply_from_the_next_step(tmp_path, uninterrupted, capfd):
    """The checkpoint's moments load into the new groups (more of them than it was saved
    with), the note names the change, and a zero LR scale holds what it matches from then on."""
    assert _train(tmp_path, "--training.steps", "10") == 0
    groups = ["norm:lr_scale=0", "tok_embeddings:weight_decay=0,lr_scale=0.5"]
    assert _train(tmp_path, "--training.steps", "12", "--optimizer.param_groups", *groups) == 0
    err = capfd.readouterr().err
    assert f"--optimizer.param_groups [] -> {groups}" in err, err[-3000:]
    want, got = _losses(uninterrupted), _losses(tmp_path)
    assert got[11] == want[11]  # the same weights; the new settings change step 11's update
    assert got[12] != want[12]
    before, after = (_weights(tmp_path / "checkpoint" / f"step-{s}") for s in (10, 12))
    norms = [k for k in before if "norm" in k]
    assert norms and all(torch.equal(before[k], after[k]) for k in norms)
    assert not torch.equal(
        before["model.tok_embeddings.weight"], after["model.tok_embeddings.weight"]
    )


def test_another_optimizers_checkpoint_is_refused_in_one_line(tmp_path, uninterrupted, capfd):
    """AdamW's moments are not Muon's momentum: one line, and the flag that starts Muon's
    state from zero (the weights, schedule and data position still load)."""
    _copy_step(uninterrupted, 10, tmp_path)
    muon = ["--training.steps", "11", "--optimizer.name", "Muon"]
    assert _train(tmp_path, *muon) == 2
    err = capfd.readouterr().err
    assert "momentum_buffer for this run's optimizer (another optimizer's state, saved by " \
        "--optimizer.name AdamW)" in err, err[-2000:]  # fmt: skip
    assert "--checkpoint.exclude_from_loading optimizer" in err
    assert _train(tmp_path, *muon, "--checkpoint.exclude_from_loading", "optimizer") == 0
    assert _losses(tmp_path)[11] == _losses(uninterrupted)[11]  # same weights and data


def test_seed_checkpoint_sets_the_initial_weights(tmp_path):
    seed_dir = tmp_path / "seeded"
    assert (
        main(
            [
                "--checkpoint.create_seed_checkpoint",
                "--debug.seed",
                "1",
                "--job.dump_folder",
                str(seed_dir),
            ]
        )
        == 0
    )
    assert _steps(seed_dir) == ["step-0"]
    # A run with another seed that finds the seed checkpoint starts from seed 1's weights.
    assert _train(seed_dir, "--training.steps", "1", "--debug.seed", "2") == 0
    reference = tmp_path / "reference"
    assert _train(reference, "--training.steps", "1", "--debug.seed", "1") == 0
    assert _losses(seed_dir)[1] == _losses(reference)[1]


# ---- several ranks -------------------------------------------------------------------------


class _SlowStager(DefaultStager):
    """Background staging on plain host memory (pinned memory needs a GPU) that starts late:
    if the optimizer stepped before the copy finished, the checkpoint would hold the next
    step's weights and the resumed run would diverge."""

    def _stage(self, state_dict, **kwargs):
        time.sleep(0.5)
        return super()._stage(state_dict, **kwargs)


def test_background_staging_is_joined_before_the_optimizer_step(
    tmp_path, uninterrupted, monkeypatch
):
    stagers = []

    def stager(async_mode, device_type):
        options = StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
        stagers.append(checkpoint_writer.reusable(_SlowStager(options)))
        return stagers[-1]

    monkeypatch.setattr(checkpoint_async, "stager_for", stager)
    mode = ["--checkpoint.async_mode", "async_with_pinned_mem"]
    assert _train(tmp_path, "--training.steps", "10", *mode) == 0
    assert _train(tmp_path, "--training.steps", "20", "--checkpoint.load_step", "5", *mode) == 0
    assert len(stagers) == 2
    want, got = _losses(uninterrupted), _losses(tmp_path)
    assert [got[s] for s in range(6, 21)] == [want[s] for s in range(6, 21)]


# by_row data: the FSDP 2 checkpoints also reshard with their dataloader position (by_document
# resume is covered by the FSDP 2 x TP 2 test and test_fault_tolerance.py).
BY_ROW = ["--training.data_sharding", "by_row"]


@pytest.fixture(scope="module")
def fsdp_uninterrupted(tmp_path_factory) -> Path:
    """FSDP 2, 10 steps, saving step 5 in the background (the final step-10 save is always
    synchronous)."""
    dump = tmp_path_factory.mktemp("fsdp_uninterrupted")
    full = _run_train(dump, "--training.steps", "10", "--checkpoint.async_mode", "async", *BY_ROW)
    assert full.returncode == 0, full.stderr[-3000:]
    assert _steps(dump) == ["step-5", "step-10"]
    return dump


def test_fsdp_resume_from_an_async_save_is_bitwise_exact(tmp_path, fsdp_uninterrupted):
    """Resumed as a rewind (--checkpoint.load_step 5 beside step-10), on 2 ranks: rank 0
    decides what loads and sets step-10 aside once step-5 has loaded; steps 6-10 train as the
    uninterrupted run's. (Synchronous saves under FSDP: the CP test below, and one process.)"""
    for step in (5, 10):
        _copy_step(fsdp_uninterrupted, step, tmp_path)
    mode = ["--checkpoint.async_mode", "async", *BY_ROW, "--checkpoint.load_step", "5"]
    resumed = _run_train(tmp_path, "--training.steps", "10", *mode)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = _losses(fsdp_uninterrupted), _losses(tmp_path)
    assert sorted(got) == list(range(6, 11))
    assert [got[s] for s in range(6, 11)] == [want[s] for s in range(6, 11)]
    assert _steps(tmp_path) == ["step-5", "step-10"]
    assert (tmp_path / "checkpoint" / "step-10.replaced").is_dir()
    assert "1 newer checkpoint(s) set aside (step-10.replaced)" in resumed.stdout + resumed.stderr


def test_a_shuffled_dataset_mix_resumes_on_another_data_parallel_degree(tmp_path):
    """A shuffled mix read by_row under FSDP 2, forked in one process at its step 5
    (--checkpoint.no_initial_load_model_only, so the fork also goes into another layout): the
    data goes on where it was (the same global batches), so the losses follow the FSDP 2
    run's."""
    mix = [
        "--training.dataset_mix",
        "python_docs:3",
        "files=tests/assets/corpus/validation.jsonl:1",
    ]
    mix += ["--training.shuffle_seed", "3"]
    fsdp = tmp_path / "fsdp"
    first = _run_train(
        fsdp, "--training.steps", "10", "--training.local_batch_size", "4", *mix, *BY_ROW
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Dataset mix (shares of the windows): python_docs 75.0%" in first.stderr
    one = tmp_path / "one"
    rows = ["--training.local_batch_size", "8"]  # the same global batch
    fork = ["--checkpoint.initial_load_path", str(fsdp / "checkpoint" / "step-5")]
    fork += ["--checkpoint.no_initial_load_model_only"]
    assert _train(one, "--training.steps", "10", *rows, *mix, *BY_ROW, *fork) == 0
    assert sorted(_losses(one)) == list(range(6, 11))
    want, got = _losses(fsdp), _losses(one)
    assert [got[s] for s in range(6, 11)] == pytest.approx(
        [want[s] for s in range(6, 11)], rel=1e-5
    )
    # Not the same data without the mix's position: restarting it changes step 6.
    restarted = tmp_path / "restarted"
    _copy_step(fsdp, 5, restarted)
    flags = ["--checkpoint.exclude_from_loading", "dataloader", "--training.steps", "6"]
    assert _train(restarted, *flags, *rows, *mix, *BY_ROW) == 0
    assert _losses(restarted)[6] != pytest.approx(want[6], rel=1e-5)


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model tensors of a DCP checkpoint directory."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    assert state, checkpoint
    return state


def test_fsdp_x_tp_resume_is_bitwise_exact_from_an_async_save(tmp_path):
    """FSDP 2 x TP 2: an uninterrupted 6-step run saves step 3 asynchronously; a run resumed
    from it (saving synchronously; resumes from synchronous saves are the CP and EP tests')
    ends the same: its losses and final weights bitwise equal. The checkpoint's by_document
    dataloader positions are per data-parallel rank: one process refuses them in one line.
    (Six steps, not eight: each step of 4 ranks on 2 busy cores costs seconds in CI.)"""
    layout = ["--parallelism.tensor_parallel_degree", "2", "--training.steps", "6"]
    full, resumed, one = tmp_path / "full", tmp_path / "resumed", tmp_path / "one"
    mode = ["--checkpoint.async_mode", "async", "--checkpoint.interval", "3"]
    result = _run_train(full, *layout, *mode, ngpu=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _steps(full) == ["step-3", "step-6"]
    for dump in (resumed, one):
        _copy_step(full, 3, dump)
    result = _run_train(resumed, *layout, "--checkpoint.interval", "3", ngpu=4)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = resumed / "checkpoint" / "step-3"
    assert f"Loading checkpoint {loaded} " in result.stdout + result.stderr
    want, got = _losses(full), _losses(resumed)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in range(4, 7)] == [want[s] for s in range(4, 7)]
    final, reference = (_weights(d / "checkpoint" / "step-6") for d in (resumed, full))
    assert final.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(final[key], tensor), key

    other_degree = _run_train(one, "--training.steps", "6", ngpu=1)
    assert other_degree.returncode != 0
    output = (other_degree.stdout + other_degree.stderr).splitlines()
    errors = [line for line in output if "data-parallel degree" in line]
    assert errors and "--checkpoint.exclude_from_loading dataloader" in errors[0], errors
    assert "by_row" in errors[0]


def test_cp_resume_is_bitwise_exact_and_loads_without_cp(tmp_path):
    """CP 2 (2 ranks: each sequence split in two, the weights FSDP-sharded over the CP ranks):
    a run resumed from step 3 ends bitwise like the uninterrupted one; the same checkpoint
    loaded by one process (the same data-parallel degree, no sequence split) trains on with the
    same losses up to the attention's summation order. (FSDP 2 x CP 2 from an FSDP checkpoint:
    test_fsdp_checkpoint_reshards_onto_other_layouts.)"""
    cp = ["--parallelism.context_parallel_degree", "2", "--checkpoint.interval", "3"]
    steps = ["--training.steps", "6", *BY_ROW]
    full, resumed, without_cp = tmp_path / "full", tmp_path / "resumed", tmp_path / "no_cp"
    result = _run_train(full, *cp, *steps)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _steps(full) == ["step-3", "step-6"]
    for dump in (resumed, without_cp):
        _copy_step(full, 3, dump)
    result = _run_train(resumed, *cp, *steps)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _train(without_cp, *steps) == 0
    want, got = _losses(full), _losses(resumed)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in range(4, 7)] == [want[s] for s in range(4, 7)]
    final, reference = (_weights(d / "checkpoint" / "step-6") for d in (resumed, full))
    assert reference.keys() == final.keys()
    assert all(torch.equal(final[k], t) for k, t in reference.items())
    plain = _losses(without_cp)
    assert [plain[s] for s in range(4, 7)] == pytest.approx(
        [want[s] for s in range(4, 7)], rel=1e-5
    )


def test_fsdp_checkpoint_reshards_onto_other_layouts(tmp_path, fsdp_uninterrupted):
    """An FSDP 2 checkpoint (model, optimizer and by_row dataloader) loads under FSDP 4,
    FSDP 2 x TP 2, TP 2, CP 2, FSDP 2 x CP 2 and one process; each then trains step 6 on the same global batch of 16
    rows as the uninterrupted run: same loss as that run, same weights in every layout."""
    _copy_step(fsdp_uninterrupted, 5, tmp_path / "source")
    load = (
        f"{' '.join(BASE)} {' '.join(BY_ROW)} --training.steps 6 --checkpoint.load_only "
        f"--checkpoint.folder {tmp_path / 'source' / 'checkpoint'}"
    )
    layouts = {
        1: {"one_process": "--training.local_batch_size 16"},
        2: {
            "tp2": "--training.local_batch_size 16 --parallelism.tensor_parallel_degree 2",
            "cp2": "--training.local_batch_size 16 --parallelism.context_parallel_degree 2",
        },
        4: {
            "fsdp4": "--training.local_batch_size 4",
            "fsdp2_tp2": "--training.local_batch_size 8 --parallelism.tensor_parallel_degree 2",
            "fsdp2_cp2": "--training.local_batch_size 8 --parallelism.context_parallel_degree 2",
        },
    }
    out = tmp_path / "out"
    out.mkdir()
    harness = str(REPO / "tests/integration_tests/numerics_harness.py")
    for ranks, cases in layouts.items():
        args = [harness, "--trainer-data", str(out)]
        args += [f"{name}:{load} {flags}" for name, flags in cases.items()]
        if ranks > 1:
            args = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", *args]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        run = subprocess.run(
            [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert run.returncode == 0, run.stderr[-3000:]
    want = _losses(fsdp_uninterrupted)[6]
    ref = torch.load(out / "one_process.pt", weights_only=True)
    for name in ("one_process", "tp2", "cp2", "fsdp4", "fsdp2_tp2", "fsdp2_cp2"):
        run = torch.load(out / f"{name}.pt", weights_only=True)
        assert [r["step"] for r in run["records"]] == [6], name  # resumed at 5, one step
        assert run["records"][0]["loss"] == pytest.approx(want, rel=1e-5), name
        for key, expected in ref["weights"].items():
            torch.testing.assert_close(
                run["weights"][key], expected, rtol=0, atol=1e-5, msg=f"{name} {key}"
            )


def test_expert_parallel_resume_is_bitwise_exact_and_reshards_to_one_process_and_back(tmp_path):
    """DeepSeek-V3 debug model, EP 2 x FSDP 2 (4 ranks; each holds 4 of 8 experts per layer,
    sharded over 2): a run resumed from step 4 ends bitwise like the uninterrupted one, expert
    biases included; its step-4 checkpoint (experts under their global names) trains on in
    one process, and that run's step-6 checkpoint back under EP 2 x FSDP 2, with the same
    losses up to summation order and the same expert biases."""
    moe = [
        "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
        "--moe.load_balance_coeff", "0.01", "--checkpoint.interval", "2",
        "--training.steps", "8", *BY_ROW,
    ]  # fmt: skip
    ep = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]
    full, resumed, one, back = (tmp_path / n for n in ("full", "resumed", "one", "back"))

    def run(dump: Path, *flags: str, ngpu: int) -> None:
        result = _run_train(dump, *moe, *flags, ngpu=ngpu)
        assert result.returncode == 0, result.stderr[-3000:]

    run(full, *ep, ngpu=4)
    assert _steps(full) == ["step-2", "step-4", "step-6", "step-8"]
    for dump in (resumed, one):
        _copy_step(full, 4, dump)
    run(resumed, *ep, ngpu=4)
    run(one, "--training.local_batch_size", "8", ngpu=1)
    _copy_step(one, 6, back)
    run(back, *ep, ngpu=4)
    want, got = _losses(full), _losses(resumed)
    assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)]
    final, reference = (_weights(d / "checkpoint" / "step-8") for d in (resumed, full))
    assert reference["model.layers.1.moe.experts.w1"].shape[0] == 8  # global, not a shard
    assert reference["model.layers.1.moe.expert_bias"].abs().sum() > 0  # moved, and saved
    assert all(torch.equal(final[k], t) for k, t in reference.items())
    plain, returned = _losses(one), _losses(back)
    assert [plain[s] for s in range(5, 9)] == pytest.approx(
        [want[s] for s in range(5, 9)], rel=1e-5
    )
    assert sorted(returned) == [7, 8]
    assert [returned[s] for s in (7, 8)] == pytest.approx([plain[s] for s in (7, 8)], rel=1e-5)
    # The same routings everywhere, so the same counts and bias steps.
    for dump in (one, back):
        biases = _weights(dump / "checkpoint" / "step-8")
        for key, tensor in reference.items():
            if key.endswith("expert_bias"):
                assert torch.equal(biases[key], tensor), (dump.name, key)

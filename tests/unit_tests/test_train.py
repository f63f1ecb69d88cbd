"""The trainer in one process: real training on the bundled corpus with the debug model."""

import dataclasses
import json
import logging
import math

import pytest
import torch

from torchtitan.components import float8
from torchtitan.components.metrics import _WandbSink
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed.precision import autocast_context
from torchtitan.tools.logging import logger
from torchtitan.train import main
from torchtitan.trainer import Trainer

SMALL = [
    "--training.seq_len", "64", "--debug.seed", "0", "--metrics.log_freq", "1",
    "--metrics.no_report",
]  # fmt: skip


def _trainer(tmp_path, *flags: str) -> Trainer:
    args = [*SMALL, "--job.dump_folder", str(tmp_path), *flags]
    return Trainer(parse_args(args, console_outputs=False))


def _metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path, *flags: str) -> tuple[list[dict], Trainer]:
    trainer = _trainer(tmp_path, *flags)
    trainer.train()
    trainer.close()
    return _metrics(tmp_path), trainer


def test_debug_model_loss_falls_over_50_steps(tmp_path):
    records, _ = _run(tmp_path, "--training.steps", "50", "--lr_scheduler.warmup_steps", "5")
    losses = [r["loss"] for r in records]
    assert len(losses) == 50 and all(math.isfinite(x) for x in losses)
    assert losses[0] > 7.5  # about ln(2048) = 7.6 at initialisation
    assert sum(losses[-10:]) / 10 < losses[0] - 1.5
    r = records[-1]
    assert r["tps"] > 0 and r["tflops"] > 0 and r["memory_peak_gib"] > 0
    assert "mfu_pct" not in r  # CPU peak FLOP/s is unknown: MFU is omitted, not invented


@pytest.mark.parametrize("local_batch", [4, 2])
def test_gradient_accumulation_equals_the_large_batch(tmp_path, local_batch):
    steps = ["--training.steps", "3", "--lr_scheduler.warmup_steps", "0"]
    big_records, big = _run(tmp_path / "big", *steps, "--training.local_batch_size", "8")
    acc_initial = {
        n: p.detach().clone()
        for n, p in _trainer(tmp_path / "init").model_parts[0].named_parameters()
    }
    acc_records, acc = _run(
        tmp_path / "acc",
        *steps,
        "--training.local_batch_size",
        str(local_batch),
        "--training.global_batch_size",
        "8",
    )
    assert acc.batches.accumulation(1) == 8 // local_batch
    for a, b in zip(acc_records, big_records, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # Micro-batching changes only the float summation order (~1e-7 relative in the gradients);
    # Adam's m / sqrt(v) amplifies that where a gradient is near zero, so weights after 3 steps
    # agree to ~1e-5, under 1% of the 3 x lr = 6e-3 the weights can move.
    (acc_model,), (big_model,) = acc.model_parts, big.model_parts
    for (name, p), q in zip(acc_model.named_parameters(), big_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-5, msg=name)
        assert not torch.equal(p, acc_initial[name])


def test_global_batch_not_a_multiple_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="--training.global_batch_size=12 must be a multiple"):
        _trainer(tmp_path, "--training.local_batch_size", "8", "--training.global_batch_size", "12")


def test_bf16_compute_tracks_fp32(tmp_path):
    fp32, _ = _run(tmp_path / "fp32", "--training.steps", "2")
    bf16, trainer = _run(
        tmp_path / "bf16", "--training.steps", "2", "--training.mixed_precision_param", "bfloat16"
    )
    (model,) = trainer.model_parts
    with trainer.runner.autocast:
        logits = model(torch.zeros(1, 8, dtype=torch.long))
    assert logits.dtype == torch.bfloat16
    # Parameters stay float32 (autocast casts per op); the loss agrees to bf16 precision.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for a, b in zip(bf16, fp32, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)


def test_resolved_config_is_saved_and_reloads_to_the_same_config(tmp_path):
    trainer = _trainer(tmp_path, "--training.steps", "1", "--optimizer.lr", "0.001")
    saved = tmp_path / "config.toml"
    assert saved.is_file()
    reloaded = parse_args(["--job.config_file", str(saved)], console_outputs=False)
    reloaded.job.config_file = None
    assert reloaded == trainer.config


def test_a_new_run_in_the_same_folder_sets_the_earlier_one_aside(tmp_path):
    """Run twice from step 0 into one dump folder: the second run's records are its own (they
    used to follow the first's, and its report counted a restart and redone steps)."""
    first, _ = _run(tmp_path, "--training.steps", "2")
    second, _ = _run(tmp_path, "--training.steps", "3")
    assert [r["step"] for r in first] == [1, 2]
    assert [r["step"] for r in second] == [1, 2, 3]
    (earlier,) = (tmp_path / "earlier_runs").iterdir()
    assert _metrics(earlier) == first
    # Each run's resolved config beside its own records.
    assert "steps = 2" in (earlier / "config.toml").read_text()
    assert "steps = 3" in (tmp_path / "config.toml").read_text()
    starts = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in starts] == ["start", "end"]


def test_a_seed_checkpoint_in_a_used_folder_begins_a_new_run(tmp_path, monkeypatch):
    """The seed run sets the earlier run aside with its config (it used to write its own config
    over the earlier run's, which the training run then filed with the earlier records); the
    run that starts from the seed moves nothing more."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "TITAN_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    first, _ = _run(tmp_path, "--training.steps", "2")
    seed = _trainer(tmp_path, "--training.steps", "7", "--checkpoint.create_seed_checkpoint")
    seed.create_seed_checkpoint()
    seed.close()
    second, _ = _run(tmp_path, "--training.steps", "3", "--checkpoint.enable")
    (earlier,) = (tmp_path / "earlier_runs").iterdir()
    assert _metrics(earlier) == first and "steps = 2" in (earlier / "config.toml").read_text()
    assert [r["step"] for r in second] == [1, 2, 3]
    assert "steps = 3" in (tmp_path / "config.toml").read_text()


def test_a_finished_run_run_again_says_there_is_nothing_to_train(tmp_path, caplog, monkeypatch):
    flags = ["--training.steps", "2", "--checkpoint.enable"]
    _run(tmp_path, *flags)
    monkeypatch.setattr(logger, "propagate", True)  # to caplog
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        again, trainer = _run(tmp_path, *flags)
    assert trainer.step == 2 and [r["step"] for r in again] == [1, 2]  # nothing more logged
    assert "Nothing to train: the run resumed at step 2, and --training.steps is 2" in caplog.text


def test_lr_logged_is_the_lr_the_step_used(tmp_path):
    records, _ = _run(
        tmp_path,
        "--training.steps",
        "3",
        "--lr_scheduler.warmup_steps",
        "3",
        "--optimizer.lr",
        "0.004",
    )
    # Warm-up factor (i + 1) / (warmup + 1) for the i-th step.
    assert [r["lr"] for r in records] == pytest.approx([0.001, 0.002, 0.003])


def test_peak_flops_override_reports_mfu(tmp_path):
    records, _ = _run(tmp_path, "--training.steps", "1", "--metrics.peak_flops", "1e12")
    assert records[0]["mfu_pct"] == pytest.approx(100 * records[0]["tflops"] / 1.0)


def _main_error(capfd, *flags: str) -> str:
    assert main(list(flags)) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    return err


def test_missing_tokenizer_is_one_clear_line(tmp_path, capfd):
    err = _main_error(
        capfd, "--model.tokenizer_path", str(tmp_path / "nope"), "--job.dump_folder", str(tmp_path)
    )
    assert "--model.tokenizer_path" in err


def test_a_model_too_large_for_this_machine_is_refused_before_its_weights_are_made(
    tmp_path, capfd, monkeypatch
):
    """The debug model's 5,770,496 float32 weights, their gradients and AdamW's two states:
    88.1 MiB, refused on a machine of 60 MiB (8B on this 24 GiB one: 119.66 GiB)."""
    from torchtitan.tools import memory_estimate

    monkeypatch.setattr(memory_estimate, "host_memory_bytes", lambda: 60 * 2**20)
    flags = [*SMALL, "--training.steps", "1", "--job.dump_folder", str(tmp_path)]
    err = _main_error(capfd, *flags)
    assert (
        "--model.flavor debugmodel of llama3 needs at least 88.1 MiB of memory and swap on this machine "
        "(1 rank: weights, gradients and optimizer state), more than its 60.0 MiB" in err
    )
    assert not (tmp_path / "metrics.jsonl").exists()
    monkeypatch.setattr(memory_estimate, "host_memory_bytes", lambda: 89 * 2**20)
    assert main(flags) == 0


@pytest.mark.parametrize(
    ("lora", "builds_whole", "trains", "per_rank"),
    [
        (False, False, True, 4),  # weights, gradients, AdamW's two states
        (False, True, True, 4),  # the whole model (1) at start-up, beside the weights (1)
        (True, True, True, 2),  # LoRA: next to nothing trains; the start-up build is the most
        (True, False, True, 1),
        (False, False, False, 1),  # a seed checkpoint: no gradient, no optimizer state
    ],
)
def test_the_host_need_is_the_larger_of_the_state_and_the_start_up_build(
    tmp_path, lora, builds_whole, trains, per_rank
):
    """In units of the debug model's weights (one process: its share is the whole model)."""
    from torchtitan.tools.memory_estimate import host_need

    flags = ["--training.steps", "1", "--job.dump_folder", str(tmp_path)]
    trainer = Trainer(parse_args([*flags, *(["--lora.rank", "2"] if lora else [])]), on_meta=True)
    weights = sum(p.numel() * 4 for p in trainer.model_parts[0].parameters())
    need = host_need(
        trainer.model_parts, optimizer_states=2, trains=trains, builds_whole=builds_whole, ranks=3
    )
    assert need.per_rank == pytest.approx(per_rank * weights, rel=0.05)  # LoRA's 1% trains
    assert need.total == 3 * need.per_rank


def test_missing_dataset_path_is_one_clear_line(tmp_path, capfd):
    err = _main_error(
        capfd,
        "--training.dataset",
        "files",
        "--training.dataset_path",
        str(tmp_path / "none.jsonl"),
        "--job.dump_folder",
        str(tmp_path),
    )
    assert "--training.dataset_path" in err


TWENTY_STEPS = ["--training.steps", "20", "--lr_scheduler.warmup_steps", "5"]


@pytest.fixture(scope="module")
def float32_run(tmp_path_factory) -> list[dict]:
    """The records of 20 float32 steps, which float8 and bf16 runs are compared with."""
    records, _ = _run(tmp_path_factory.mktemp("float32"), *TWENTY_STEPS)
    return records


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_trains_like_high_precision(tmp_path, float32_run, recipe):
    """torchao's float8 linears on this CPU (real ``_scaled_mm``): the loss falls as in
    float32 and stays within 2% of it at every one of 20 steps."""
    plain = float32_run
    flags = ["--float8.enable", "--float8.recipe_name", recipe]
    if recipe != "tensorwise" and not float8.cpu_takes_row_scales():
        flags.append("--float8.emulate")  # torch 2.11's CPU matmul refuses row-wise scales
    records, trainer = _run(tmp_path / recipe, *TWENTY_STEPS, *flags)
    model = trainer.model_parts[0]
    assert type(model.layers["0"].attention.wq).__name__ == "Float8Linear"
    assert type(model.output) is torch.nn.Linear  # filtered: stays in high precision
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 1.0
    for got, want in zip(losses, (r["loss"] for r in plain), strict=True):
        assert got == pytest.approx(want, rel=0.02)


def test_a_sample_is_printed_after_training(tmp_path, capfd):
    """``--validation.sample_prompt`` (what ``make train`` passes): the trained model's seeded
    continuation, the same text for the same weights."""
    flags = ["--training.steps", "2", "--validation.sample_prompt", "The "]
    texts = []
    for run in ("a", "b"):
        capfd.readouterr()
        assert main([*SMALL, "--job.dump_folder", str(tmp_path / run), *flags]) == 0
        out = capfd.readouterr()
        texts.append((out.out + out.err).split("INFO Sample (40 tokens", 1)[1])
    assert texts[0] == texts[1] and texts[0].split("\n    ", 1)[1].startswith("The ")


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records, _ = _run(tmp_path, "--training.steps", "2", "--metrics.enable_tensorboard")
    (run_dir,) = (tmp_path / "tb").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == [1, 2]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in records])
    assert {"grad_norm", "tps", "lr"} <= set(events.Tags()["scalars"])


def test_bf16_parameters_start_from_the_float32_init_and_keep_their_state_in_bf16(
    tmp_path, float32_run
):
    """--training.dtype bfloat16: the float32 initialisation rounded to bf16, buffers left
    float32; gradients and AdamW's moments in bf16; the first loss is float32's within
    bf16's rounding, and the run trains like float32."""
    fp32 = _trainer(tmp_path / "fp32", *TWENTY_STEPS)
    init = {n: p.detach().clone() for n, p in fp32.model_parts[0].named_parameters()}
    buffers = {n: b.dtype for n, b in fp32.model_parts[0].named_buffers()}
    fp32.close()
    bf16 = _trainer(tmp_path / "bf16", *TWENTY_STEPS, "--training.dtype", "bfloat16")
    (model,) = bf16.model_parts
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert torch.equal(p, init[name].to(torch.bfloat16)), name
    assert {n: b.dtype for n, b in model.named_buffers()} == buffers
    assert buffers == {"rope_cis": torch.complex64}  # the RoPE table, in float32 pairs
    grads = {}

    def record(p: torch.Tensor) -> None:
        grads[id(p)] = p.grad.dtype

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(record)
    bf16.train()
    bf16.close()
    assert set(grads.values()) == {torch.bfloat16} and len(grads) == len(init)
    (optimizer,) = bf16.optimizers.optimizers
    assert len(optimizer.state) == len(grads)
    for state in optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    want, got = [r["loss"] for r in float32_run], [r["loss"] for r in _metrics(tmp_path / "bf16")]
    assert got[0] == pytest.approx(want[0], abs=5e-3)
    assert got[-1] < got[0] - 1.0
    assert got == pytest.approx(want, rel=0.02)


def test_casting_parameters_keeps_ties_buffers_and_integers():
    from torchtitan.distributed.precision import cast_parameters_

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    model.register_buffer("table", torch.ones(3))
    model.register_parameter("count", torch.nn.Parameter(torch.ones(2, dtype=torch.int64), False))
    cast_parameters_(model, torch.bfloat16)
    assert model[1].weight is model[0].weight and model[0].weight.dtype == torch.bfloat16
    assert model.table.dtype == torch.float32 and model.count.dtype == torch.int64
    assert model[0].weight.requires_grad and not model.count.requires_grad


def test_bf16_is_applied_once_whatever_the_parallelism(tmp_path):
    """autocast exactly when no data-parallel mixed-precision policy casts parameters."""
    import contextlib

    from torchtitan.distributed import ParallelDims

    trainer = _trainer(
        tmp_path, "--training.steps", "1", "--training.mixed_precision_param", "bfloat16"
    )
    cases = {
        (1, 1, 1): True,  # one process
        (1, 1, 2): True,  # TP only: nothing else casts
        (1, 2, 1): False,  # FSDP's MixedPrecisionPolicy casts
        (2, 1, 1): False,  # replicate uses the same policy
        (1, 2, 2): False,
    }
    training = trainer.config.training
    bf16_params = dataclasses.replace(training, dtype="bfloat16")
    for (rep, shard, tp), autocast in cases.items():
        dims = ParallelDims(rep, shard, 1, tp, 1, 1, world_size=rep * shard * tp)
        context = autocast_context(dims, training, "cpu")
        assert isinstance(context, torch.autocast) == autocast, (rep, shard, tp)
        assert isinstance(context, contextlib.nullcontext) != autocast
        # bf16 parameters compute in bf16 with nothing to cast
        assert isinstance(autocast_context(dims, bf16_params, "cpu"), contextlib.nullcontext)


def test_wandb_offline_run_records_the_logged_values(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    records, _ = _run(tmp_path, "--training.steps", "2", "--metrics.enable_wandb")
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    # History values are stored as JSON text inside the run's protobuf records.
    for record in records:
        assert json.dumps(record["loss"]).encode() in data
    assert b"grad_norm" in data and b"tps" in data
    # The run's resolved config, to compare runs by in W&B.
    assert b"local_batch_size" in data and b"debugmodel" in data


def test_wandb_without_an_account_is_refused_in_one_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with pytest.raises(ConfigError) as refused:
        _WandbSink(str(tmp_path), 0, {})
    message = str(refused.value)  # wandb's own reason between the parentheses
    assert message.startswith("--metrics.enable_wandb: W&B could not start a run (")
    assert "API key" in message and "\n" not in message
    assert message.endswith(
        "); run `wandb login` or set WANDB_API_KEY, or log without an account with "
        f"WANDB_MODE=offline (the run's files go to {tmp_path}/wandb)"
    )


def test_forward_only_loss_equals_the_training_forward_and_leaves_no_trace(tmp_path):
    trainer = _trainer(tmp_path, "--training.steps", "1")
    (model,) = trainer.model_parts
    batch = next(iter(trainer.dataloader))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    evaluated = trainer.runner.loss(batch)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    result = trainer.train_step([batch])  # its loss is the forward before the update
    trainer.close()
    assert evaluated.dtype == torch.float64
    assert torch.equal(evaluated, result.loss_sum)

"""LoRA fine-tuning as a user runs it: from a Hugging Face model, only the adapters train, the
run resumes exactly, and what it exports is a plain HF model that computes the adapted one."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from launch import REPO, clean_env, records, run_train  # noqa: E402
from test_hf_checkpoint import _hf_folder, _hf_loss  # noqa: E402

from torchtitan.components import checkpoint_hf  # noqa: E402
from torchtitan.components.checkpoint_files import read_full_model  # noqa: E402
from torchtitan.train import main  # noqa: E402

# A constant LR after warm-up: "train 2, stop, resume to 4" must reproduce "train 4".
BASE = [
    "--training.seq_len", "64", "--debug.seed", "0", "--debug.deterministic",
    "--metrics.log_freq", "1", "--metrics.no_report", "--lr_scheduler.warmup_steps", "2",
    "--lr_scheduler.decay_type", "constant", "--training.data_sharding", "by_row",
    "--checkpoint.enable", "--checkpoint.interval", "2",
]  # fmt: skip
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--optimizer.lr", "1e-2"]

pytestmark = pytest.mark.integration


def _train(dump: Path, *flags: str) -> int:
    return main([*BASE, *LORA, "--job.dump_folder", str(dump), *flags])


def _losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(dump)}


def _is_adapter(name: str) -> bool:
    return name.endswith((".lora_a", ".lora_b"))


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return _hf_folder(tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, hf) -> Path:
    """4 LoRA steps from the HF model in one process, saved at 2 and 4, exported to HF."""
    dump = tmp_path_factory.mktemp("tuned")
    flags = ["--checkpoint.initial_load_path", str(hf), "--training.local_batch_size", "8"]
    assert _train(dump, *flags, "--training.steps", "4", "--checkpoint.last_save_in_hf") == 0
    return dump


def test_only_the_adapters_train_from_the_hf_weights(tuned, hf):
    losses = _losses(tuned)
    # B starts at zero: the first step computes the HF model's own loss; then the adapters learn.
    assert losses[1] == pytest.approx(_hf_loss(hf), rel=1e-5)
    assert losses[4] < losses[1] - 0.05
    two, four = (read_full_model(tuned / f"checkpoint/step-{s}") for s in (2, 4))
    adapters = [k for k in four if _is_adapter(k)]
    assert len(adapters) == 2 * 7 * 6  # q, k, v, o and the 3 FFN projections of 6 blocks
    assert all(not torch.equal(two[k], four[k]) for k in adapters)
    frozen = [k for k in four if not _is_adapter(k)]
    assert all(torch.equal(two[k], four[k]) for k in frozen)
    # The frozen weights are the HF model's (a projection the adapter maps without a permute).
    hf_tensors = checkpoint_hf.read_tensors(hf)
    torch.testing.assert_close(
        four["layers.3.feed_forward.w2.weight"],
        hf_tensors["model.layers.3.mlp.down_proj.weight"],
        rtol=0,
        atol=0,
    )
    # Optimizer state exists for the adapters only.
    metadata = dcp.FileSystemReader(str(tuned / "checkpoint/step-2")).read_metadata()
    exp_avg = [k for k in metadata.state_dict_metadata if k.startswith("optimizer.state.")]
    exp_avg = [k for k in exp_avg if k.endswith(".exp_avg")]
    assert exp_avg and all(_is_adapter(k.removesuffix(".exp_avg")) for k in exp_avg)
    assert len(exp_avg) == len(adapters)


def test_a_lora_run_resumes_bitwise(tmp_path, tuned, hf):
    load = ["--checkpoint.initial_load_path", str(hf), "--training.local_batch_size", "8"]
    assert _train(tmp_path, *load, "--training.steps", "2") == 0
    assert _train(tmp_path, *load, "--training.steps", "4") == 0
    want, got = _losses(tuned), _losses(tmp_path)
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]


def test_the_export_is_the_adapted_model_merged(tuned, hf, tmp_path):
    from torchtitan.generate import load_model

    export = tuned / "checkpoint/hf-step-4"
    tensors = checkpoint_hf.read_tensors(export)
    assert not any("lora" in k for k in tensors)
    # Sampling from the step merges the adapters too: its logits are transformers'.
    ours, _, _ = load_model(tuned / "checkpoint/step-4", None, None, torch.device("cpu"))
    theirs = transformers.LlamaForCausalLM.from_pretrained(export).eval()
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)
    assert _hf_loss(export) != pytest.approx(_hf_loss(hf), rel=1e-3)
    # Converting the step gives the same tensors as the trainer's export.
    out = tmp_path / "converted"
    done = subprocess.run(
        [sys.executable, "scripts/convert_hf.py", "to_hf", str(tuned / "checkpoint/step-4"),
         str(out)], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    converted = checkpoint_hf.read_tensors(out)
    assert converted.keys() == tensors.keys()
    assert all(torch.equal(converted[k], tensors[k]) for k in tensors)


def test_resuming_with_another_lora_setting_is_refused_in_one_line(tuned, tmp_path, capfd):
    dump = tmp_path / "copy"
    shutil.copytree(tuned, dump)
    flags = [*BASE, "--job.dump_folder", str(dump), "--training.steps", "6"]
    assert main([*flags, "--checkpoint.load_step", "2"]) == 2
    err = capfd.readouterr().err
    assert "--lora.rank 4 (this run: 0)" in err and "does not fit this model" in err
    # Another alpha changes no shape but rescales every adapter.
    assert main([*flags, *LORA, "--lora.alpha", "64", "--checkpoint.load_step", "2"]) == 2
    err = capfd.readouterr().err
    assert "holds LoRA adapters trained with --lora.alpha 8.0, this run has 64.0" in err


def test_simulated_ranks_and_dry_runs_take_lora(tuned, hf, tmp_path):
    """COMM_MODE=local_tensor imports the HF model around the adapters and trains like one
    process; a dry run sizes adapters named by block number (its probes have 1-2 blocks)."""
    result = run_train(
        tmp_path / "sim", *BASE, *LORA, "--checkpoint.initial_load_path", str(hf),
        "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
        "--training.steps", "2", ngpu=4, COMM_MODE="local_tensor",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    want, got = _losses(tuned), _losses(tmp_path / "sim")
    assert [got[s] for s in (1, 2)] == pytest.approx([want[s] for s in (1, 2)], rel=1e-5)
    result = run_train(
        tmp_path / "dry", "--lora.rank", "4", "--lora.target_modules", "layers.5.attention.wq",
        ngpu=2, COMM_MODE="fake_backend",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LoRA rank 4 on 1 linear layers" in result.stderr
    # DeepSeek-V3's probes have only MoE blocks: a target in its dense blocks alone.
    result = run_train(
        tmp_path / "dry_deepseek", "--module", "deepseek_v3", "--config",
        "deepseek_v3_debugmodel", "--lora.rank", "4", "--lora.target_modules", "feed_forward.w1",
        ngpu=2, COMM_MODE="fake_backend",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


def test_adapter_only_runs_train_on_the_initial_weights_even_from_a_seed(hf, tmp_path):
    """A seed checkpoint holds random frozen weights; a run that saves adapters only reads the
    frozen ones from --checkpoint.initial_load_path on every resume, so it must train on those
    from the start too."""
    dump = tmp_path / "run"
    seed = [*BASE, *LORA, "--job.dump_folder", str(dump), "--checkpoint.create_seed_checkpoint"]
    assert main(seed) == 0
    flags = [
        "--checkpoint.initial_load_path", str(hf), "--training.local_batch_size", "8",
        "--lora.save_adapters_only", "--job.dump_folder", str(dump), "--training.steps", "1",
    ]  # fmt: skip
    assert main([*BASE, *LORA, *flags]) == 0
    assert _losses(dump)[1] == pytest.approx(_hf_loss(hf), rel=1e-5)


def test_the_peft_adapters_on_the_base_model_are_the_merged_export(tuned, hf):
    """``peft-step-4``: the adapters alone in PEFT's format, which ``peft`` loads onto the HF
    model they were trained from; that computes what the merged export computes."""
    peft = pytest.importorskip("peft")
    adapters = tuned / "checkpoint/peft-step-4"
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf)
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert len(config["target_modules"]) == 7 * 6  # every linear layer of the 6 blocks
    base = transformers.LlamaForCausalLM.from_pretrained(hf)
    adapted = peft.PeftModel.from_pretrained(base, adapters).eval()
    merged = transformers.LlamaForCausalLM.from_pretrained(tuned / "checkpoint/hf-step-4").eval()
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = merged(tokens).logits
        torch.testing.assert_close(adapted(tokens).logits, want, rtol=1e-5, atol=1e-5)
        # (and the adapters matter: without them the base model computes otherwise)
        with adapted.disable_adapter():
            assert not torch.allclose(adapted(tokens).logits, want, atol=1e-3)


def test_tensor_and_data_parallel_lora_import_and_export_equal_one_process(tuned, hf, tmp_path):
    result = run_train(
        tmp_path, *BASE, *LORA, "--checkpoint.initial_load_path", str(hf),
        "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
        "--training.steps", "4", "--checkpoint.last_save_in_hf", ngpu=4, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    want, got = _losses(tuned), _losses(tmp_path)
    assert [got[s] for s in range(1, 5)] == pytest.approx([want[s] for s in range(1, 5)], rel=1e-5)
    ours = checkpoint_hf.read_tensors(tmp_path / "checkpoint/hf-step-4")
    one = checkpoint_hf.read_tensors(tuned / "checkpoint/hf-step-4")
    assert ours.keys() == one.keys()
    for key, value in one.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=5e-5, msg=key)
    config = json.loads((tmp_path / "checkpoint/hf-step-4/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    # The PEFT adapters gathered from TP and FSDP shards compute one process's: B·A, as the
    # merged weights above (A alone moves with summation order while B is near zero).
    ours, one = (
        load_file(run / "checkpoint/peft-step-4/adapter_model.safetensors")
        for run in (tmp_path, tuned)
    )
    assert ours.keys() == one.keys() and len(one) == 2 * 7 * 6
    for key in (k for k in one if k.endswith("lora_A.weight")):
        b = key.replace("lora_A", "lora_B")
        torch.testing.assert_close(
            ours[b] @ ours[key], one[b] @ one[key], rtol=0, atol=5e-5, msg=key
        )


def test_adapters_only_saves_resume_and_sample_like_full_ones(tuned, hf, tmp_path, capfd):
    from torchtitan.generate import load_model

    flags = [
        "--checkpoint.initial_load_path", str(hf), "--training.local_batch_size", "8",
        "--lora.save_adapters_only",
    ]  # fmt: skip
    assert _train(tmp_path, *flags, "--training.steps", "2") == 0
    assert _train(tmp_path, *flags, "--training.steps", "4") == 0
    # The resume read the frozen weights from the HF folder again, then the step.
    assert "Loading Hugging Face weights" in capfd.readouterr().err
    want, got = _losses(tuned), _losses(tmp_path)
    assert [got[s] for s in range(1, 5)] == [want[s] for s in range(1, 5)]
    saved = read_full_model(tmp_path / "checkpoint/step-4")
    assert saved and all(_is_adapter(k) for k in saved)

    def size(step: Path) -> int:
        return sum(f.stat().st_size for f in step.iterdir())

    assert size(tmp_path / "checkpoint/step-4") < size(tuned / "checkpoint/step-4") / 3
    # Sampling completes the step with the frozen weights: the full save's model exactly.
    device = torch.device("cpu")
    ours, _, _ = load_model(tmp_path / "checkpoint/step-4", None, None, device)
    full, _, _ = load_model(tuned / "checkpoint/step-4", None, None, device)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(tokens), full(tokens))
    # Without the flag the run would need frozen weights its steps do not hold: refused.
    assert main([*BASE, *LORA, "--job.dump_folder", str(tmp_path), "--training.steps", "6"]) == 2
    err = capfd.readouterr().err
    assert "--lora.save_adapters_only True (this run: False)" in err
    # Fewer adapters than the step holds would drop trained ones: refused too.
    assert _train(tmp_path, *flags, "--training.steps", "6", "--lora.target_modules", "wq") == 2
    assert "of its tensors are not in this model" in capfd.readouterr().err


def test_adapters_only_steps_refuse_frozen_weights_that_changed(hf, tmp_path):
    from safetensors.torch import load_file, save_file

    from torchtitan.config.errors import ConfigError
    from torchtitan.generate import load_model

    source = tmp_path / "hf"
    shutil.copytree(hf, source)
    dump = tmp_path / "run"
    flags = [
        "--checkpoint.initial_load_path", str(source), "--training.local_batch_size", "8",
        "--lora.save_adapters_only", "--job.dump_folder", str(dump),
    ]  # fmt: skip
    assert main([*BASE, *LORA, *flags, "--training.steps", "2"]) == 0
    assert (dump / "checkpoint/step-2/frozen_source.json").is_file()
    # Such a step cannot start another run: it lacks the frozen weights (however it is spelt).
    other = [
        "--job.dump_folder", str(tmp_path / "other"), "--training.steps", "1",
        "--checkpoint.initial_load_path", f"{dump}/checkpoint/./step-2/",
    ]  # fmt: skip
    assert main([*BASE, *LORA, *other]) == 2
    # Files beside the weights may change (generation settings, a tokenizer).
    (source / "generation_config.json").write_text('{"temperature": 0.7}')
    load_model(dump / "checkpoint/step-2", None, None, torch.device("cpu"))
    # Other weights of the same shapes (a fine-tuned variant, say): same sizes, other bytes.
    shard = next(source.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="changed since it was saved"):
        load_model(dump / "checkpoint/step-2", None, None, torch.device("cpu"))
    assert main([*BASE, *LORA, *flags, "--training.steps", "4"]) == 2
    shutil.move(source, tmp_path / "moved")
    with pytest.raises(ConfigError, match="without the frozen weights, which its run read from"):
        load_model(dump / "checkpoint/step-2", None, None, torch.device("cpu"))

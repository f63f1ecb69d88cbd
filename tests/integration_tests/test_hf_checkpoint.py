"""Hugging Face weights in a real run: ``--checkpoint.initial_load_path HF_FOLDER`` under
FSDP 2 x TP 2 starts from the same first loss as one process, and ``--checkpoint.last_save_in_hf``
under FSDP 2 and PP 2 writes what one process writes, which ``transformers`` loads."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from launch import REPO, clean_env, records, run_train  # noqa: E402

from torchtitan.components import checkpoint_hf  # noqa: E402
from torchtitan.components.tokenizer import build_tokenizer  # noqa: E402
from torchtitan.models.llama3.args import flavors  # noqa: E402

BASE = [
    "--debug.deterministic", "--training.data_sharding", "by_row", "--checkpoint.enable",
    "--lr_scheduler.warmup_steps", "2",
]  # fmt: skip

pytestmark = pytest.mark.integration


def _run(dump: Path, ngpu: int, *flags: str) -> list[float]:
    result = run_train(dump, *BASE, *flags, ngpu=ngpu, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [r["loss"] for r in records(dump)]


def _hf_folder(path: Path) -> Path:
    a = flavors["debugmodel"]
    config = transformers.LlamaConfig(
        hidden_size=a.dim, intermediate_size=a.ffn_hidden_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab_size,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _hf_loss(model_or_folder, tokenizer: Path = REPO / "tests/assets/tokenizer") -> float:
    from torchtitan.components.dataloader import build_dataloader

    loader = build_dataloader(
        dataset="python_docs", dataset_path=None, seq_len=64, local_batch_size=8,
        tokenizer=build_tokenizer(tokenizer), dp_rank=0, dp_world_size=1,
    )  # fmt: skip
    inputs, labels = next(iter(loader))
    model = model_or_folder
    if isinstance(model, Path):
        model = transformers.LlamaForCausalLM.from_pretrained(model).eval()
    with torch.no_grad():
        logits = model(inputs["input"]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


def test_hf_import_in_any_layout_and_export_from_sharded_runs(tmp_path):
    hf = _hf_folder(tmp_path / "hf")
    load = ["--checkpoint.initial_load_path", str(hf), "--training.steps", "2"]
    one = _run(tmp_path / "one", 1, *load, "--training.local_batch_size", "8")
    sharded = _run(
        tmp_path / "fsdp2_tp2", 4, *load, "--training.local_batch_size", "4",
        "--parallelism.tensor_parallel_degree", "2",
    )  # fmt: skip
    assert sharded == pytest.approx(one, rel=1e-5)
    # The first loss is the HF model's own on the first global batch.
    assert one[0] == pytest.approx(_hf_loss(hf), rel=1e-5)

    export = ["--checkpoint.last_save_in_hf", "--training.steps", "3"]
    runs = {
        "1": (1, ["--training.local_batch_size", "8"]),
        "fsdp2": (2, ["--training.local_batch_size", "4"]),
        "pp2": (2, ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree",
                    "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    }  # fmt: skip
    exported = {}
    for name, (ngpu, flags) in runs.items():
        _run(tmp_path / name, ngpu, *export, *flags)
        exported[name] = checkpoint_hf.read_tensors(tmp_path / name / "checkpoint" / "hf-step-3")
    assert len(exported["1"]) == 2 + 6 * 9 + 1  # embedding, 6 blocks of 9, norm; lm_head below
    for name in ("fsdp2", "pp2"):
        assert exported[name].keys() == exported["1"].keys()
        for key, want in exported["1"].items():
            torch.testing.assert_close(exported[name][key], want, rtol=0, atol=5e-5, msg=key)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pp2/checkpoint/hf-step-3")
    assert not model.config.tie_word_embeddings and model.config.num_hidden_layers == 6
    # The export carries the run's tokenizer (tiktoken, converted): transformers encodes alike.
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "pp2/checkpoint/hf-step-3")
    ours = build_tokenizer(REPO / "tests/assets/tokenizer")
    assert (model.config.bos_token_id, model.config.eos_token_id) == (ours.bos_id, ours.eos_id)
    text = "Return the sum of the list."
    assert tokenizer(text)["input_ids"] == ours.encode(text, add_bos=True)

    # Sampling from the run's checkpoint: tensor parallel gives the one-process text.
    sample = ["-m", "torchtitan.generate", str(tmp_path / "1"), "--prompt", "The ",
              "--max_new_tokens", "12", "--temperature", "0.8", "--seed", "1"]  # fmt: skip
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
                "--rdzv_endpoint", "localhost:0"]  # fmt: skip
    # ... and so does its HF export, with the tokenizer the export carries.
    from_hf = [*sample[:2], str(tmp_path / "1/checkpoint/hf-step-3"), *sample[3:]]
    texts = []
    for cmd in (sample, [*torchrun, *sample, "--tp", "2"], from_hf):
        done = subprocess.run(
            [sys.executable, *cmd], cwd=REPO, env=clean_env(), capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        texts.append(done.stdout)
    assert texts[0].startswith("The ") and texts[0] == texts[1] == texts[2]


def _deepseek_style_tokenizer(folder: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` trained on the corpus by the ``tokenizers`` library,
    shaped like DeepSeek's (bos 0 and eos 1 with its names, given as AddedToken entries in
    ``tokenizer_config.json``; no tiktoken file)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bos, eos = (
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
    )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=[bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    lines = (REPO / "tests/assets/corpus/train.jsonl").read_text().splitlines()
    tokenizer.train_from_iterator([json.loads(line)["text"] for line in lines], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    added = {"__type": "AddedToken", "lstrip": False, "normalized": True, "rstrip": False}
    config = {"bos_token": added | {"content": bos}, "eos_token": added | {"content": eos},
              "add_bos_token": True, "tokenizer_class": "LlamaTokenizerFast"}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _one_process_and_ep2(tmp_path: Path, flags: list[str]) -> list[float]:
    """Runs ``flags`` in one process (``one``) and on EP 2 ranks (``ep2``), the same global
    batch; their losses must be equal. Returns them."""
    one = _run(tmp_path / "one", 1, *flags, "--training.local_batch_size", "8")
    ep = _run(
        tmp_path / "ep2", 2, *flags, "--training.local_batch_size", "4",
        "--parallelism.expert_parallel_degree", "2",
    )  # fmt: skip
    assert ep == pytest.approx(one, rel=1e-5)
    return one


def test_deepseek_hf_import_under_expert_parallelism(tmp_path):
    """A DeepSeek-V3 HF folder (per-expert tensors) read by EP 2 ranks, each keeping its own
    experts: the losses of one process, the first one the HF model's own. Trained with the
    folder's own tokenizer (``tokenizer.json`` only, as DeepSeek ships it)."""
    from torchtitan.models.deepseek_v3.args import flavors as deepseek_flavors
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    args = dataclasses.replace(deepseek_flavors["debugmodel"], max_seq_len=64)
    fields = DeepSeekV3StateDictAdapter(args).hf_config(
        tied=False, dtype=torch.float32, bos_id=None, eos_id=None
    )
    config = transformers.DeepseekV3Config(**fields)
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(tmp_path / "hf")
    _deepseek_style_tokenizer(tmp_path / "hf")
    assert build_tokenizer(tmp_path / "hf").bos_id == 0
    flags = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--training.steps",
             "2", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
             "--model.tokenizer_path", str(tmp_path / "hf")]  # fmt: skip
    one = _one_process_and_ep2(tmp_path, flags)
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert one[0] == pytest.approx(_hf_loss(model, tmp_path / "hf"), rel=1e-5)


def test_qwen3_moe_hf_in_and_out_under_expert_parallelism(tmp_path):
    """A Qwen3-MoE HF folder (per-expert tensors, ``transformers``' Qwen3MoeForCausalLM)
    trained by one process and by EP 2 ranks: the same losses, the first one the HF model's
    own; both export what ``transformers`` loads, the same weights."""
    from torchtitan.models.qwen3.args import flavors as qwen3_flavors
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    args = dataclasses.replace(qwen3_flavors["debugmodel_moe"], max_seq_len=64)
    fields = Qwen3StateDictAdapter(args).hf_config(
        tied=False, dtype=torch.float32, bos_id=None, eos_id=None
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields)).save_pretrained(
        tmp_path / "hf"
    )
    flags = ["--module", "qwen3", "--config", "qwen3_moe_debugmodel", "--training.steps", "2",
             "--checkpoint.initial_load_path", str(tmp_path / "hf"),
             "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "float32"]  # fmt: skip
    one = _one_process_and_ep2(tmp_path, flags)
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert one[0] == pytest.approx(_hf_loss(model), rel=1e-5)
    exports = [tmp_path / run / "checkpoint/hf-step-2" for run in ("one", "ep2")]
    trained = transformers.AutoModelForCausalLM.from_pretrained(exports[1]).eval()
    assert type(trained).__name__ == "Qwen3MoeForCausalLM"
    assert _hf_loss(trained) < one[0]  # two steps from the import moved it
    first, second = (checkpoint_hf.read_tensors(e) for e in exports)
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        torch.testing.assert_close(second[name], tensor, rtol=0, atol=5e-5, msg=name)


def test_an_export_without_a_place_for_the_routing_bias_is_refused_on_every_stage(tmp_path):
    """A Qwen3-MoE run resumed (routing bias frozen, --moe.load_balance_coeff 0) from one that
    learned a bias, exported in HF form from 2 pipeline stages: every rank refuses in one line
    (none waits in the export's collectives), exit 2; the DCP checkpoint stands, no HF folder."""
    flags = ["--module", "qwen3", "--config", "qwen3_moe_debugmodel", "--checkpoint.enable",
             "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_microbatch_size", "4"]  # fmt: skip
    first = run_train(tmp_path, *flags, "--training.steps", "2", "--moe.load_balance_coeff", "0.01",
                      ngpu=2, timeout=600)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_train(
        tmp_path, *flags, "--training.steps", "3", "--checkpoint.last_save_in_hf", ngpu=2,
        log_rank="0,1", timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    errors = [line for line in resumed.stderr.splitlines() if "error: " in line]
    assert errors and all("expert_bias" in line and "no place for it" in line for line in errors)
    assert (tmp_path / "checkpoint/step-3").is_dir()
    assert not (tmp_path / "checkpoint/hf-step-3").exists()

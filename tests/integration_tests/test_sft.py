"""Supervised fine-tuning as a user runs it: conversations from the bundled chat dataset on a
Hugging Face model. The first loss is the HF model's mean loss over the answers' tokens
(computed here with ``transformers`` alone: its tokenizer, chat template and model, each sample
run alone), packed or not; the run resumes bitwise mid-window; the export carries the chat
template."""

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from launch import REPO, records  # noqa: E402

from torchtitan.models.llama3.args import flavors  # noqa: E402
from torchtitan.train import main  # noqa: E402

SEQ = 256
BATCH = 4
BASE = [
    "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH),
    "--debug.seed", "0", "--debug.deterministic", "--metrics.log_freq", "1",
    "--metrics.no_report", "--lr_scheduler.warmup_steps", "2",
    "--lr_scheduler.decay_type", "constant", "--training.data_sharding", "by_row",
    "--training.dataset", "chat_demo", "--training.data_format", "chat",
]  # fmt: skip

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    a = flavors["debugmodel"]
    config = transformers.LlamaConfig(
        hidden_size=a.dim, intermediate_size=a.ffn_hidden_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab_size,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, max_position_embeddings=SEQ,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(dump)}


def _samples() -> list[tuple[list[int], list[bool]]]:
    """Each bundled conversation's ids and which positions predict an answer token, from
    ``transformers``' ``apply_chat_template`` (the answer of turn i: the tokens after the
    conversation up to it with the generation prompt, through the conversation with it)."""
    tok = transformers.AutoTokenizer.from_pretrained(REPO / "tests/assets/tokenizer_hf")

    def ids(messages, prompt=False):
        out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
        return out if isinstance(out, list) else out["input_ids"]

    samples = []
    lines = (REPO / "tests/assets/chat/train.jsonl").read_text().splitlines()[:60]
    for line in lines:
        messages = json.loads(line)["messages"]
        whole = ids(messages)
        answer = [False] * len(whole)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                for j in range(len(ids(messages[:i], prompt=True)), len(ids(messages[: i + 1]))):
                    answer[j] = True
        samples.append((whole, answer[1:]))  # position j predicts token j + 1
    return samples


def _first_batch(packed: bool) -> list[tuple[list[int], list[bool]]]:
    """The samples of the first step: one per row, or packed in order into rows of SEQ."""
    taken, rows, filled = [], 0, 0
    for whole, predicts in _samples():
        n = len(whole) - 1
        if n > SEQ:
            continue
        if packed and filled + n > SEQ:
            rows, filled = rows + 1, 0
        if rows == BATCH:
            break
        taken.append((whole, predicts))
        filled += n
        if not packed or filled == SEQ:
            rows, filled = rows + 1, 0
        if rows == BATCH:
            break
    return taken


def _hf_answer_loss(hf: Path, packed: bool) -> float:
    model = transformers.LlamaForCausalLM.from_pretrained(hf).eval()
    total, count = 0.0, 0
    for whole, predicts in _first_batch(packed):
        with torch.no_grad():
            logits = model(torch.tensor([whole[:-1]])).logits[0]
        keep = torch.tensor(predicts)
        targets = torch.tensor(whole[1:])
        total += torch.nn.functional.cross_entropy(
            logits[keep].double(), targets[keep], reduction="sum"
        ).item()
        count += int(keep.sum())
    return total / count


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
def test_the_first_loss_is_the_hf_models_loss_on_the_answers(hf, tmp_path, mask):
    flags = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(hf)]
    flags += ["--model.attn_mask", mask]
    assert main([*BASE, *flags, "--training.steps", "1", "--job.dump_folder", str(tmp_path)]) == 0
    assert _losses(tmp_path)[1] == pytest.approx(
        _hf_answer_loss(hf, mask == "block_causal"), rel=1e-5
    )


def test_a_packed_run_resumes_bitwise_and_exports_its_template(hf, tmp_path):
    flags = [
        "--checkpoint.initial_load_path", str(hf), "--model.attn_mask", "block_causal",
        "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_in_hf",
    ]  # fmt: skip
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main([*BASE, *flags, "--training.steps", "4", "--job.dump_folder", str(whole)]) == 0
    assert main([*BASE, *flags, "--training.steps", "2", "--job.dump_folder", str(resumed)]) == 0
    assert main([*BASE, *flags, "--training.steps", "4", "--job.dump_folder", str(resumed)]) == 0
    want, got = _losses(whole), _losses(resumed)
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]
    assert want[4] < want[1]
    # The export chats like the bundled tokenizer: transformers reads its template.
    export = whole / "checkpoint/hf-step-4"
    template = (REPO / "tests/assets/tokenizer/chat_template.jinja").read_text()
    assert (export / "chat_template.jinja").read_text() == template
    tok = transformers.AutoTokenizer.from_pretrained(export)
    ours = transformers.AutoTokenizer.from_pretrained(REPO / "tests/assets/tokenizer_hf")
    messages = [{"role": "user", "content": "What does os.getcwd do?"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == (
        ours.apply_chat_template(messages, add_generation_prompt=True)
    )


def test_a_runs_own_template_travels_with_its_steps(tmp_path, capsys):
    """--training.chat_template: each step holds it, and sampling from the step and converting
    it to HF use it (not the tokenizer folder's)."""
    import subprocess
    import sys

    from launch import clean_env

    from torchtitan import generate

    custom = tmp_path / "custom.jinja"
    custom.write_text(
        "{% for m in messages %}### {{ m.role | upper }}: {{ m.content }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}### ASSISTANT: {% endif %}"
    )
    dump = tmp_path / "run"
    flags = ["--training.chat_template", str(custom), "--training.steps", "2"]
    flags += ["--checkpoint.enable", "--job.dump_folder", str(dump)]
    assert main([*BASE, *flags]) == 0
    step = dump / "checkpoint/step-2"
    assert (step / "chat_template.jinja").read_text() == custom.read_text()
    capsys.readouterr()
    assert generate.main([str(dump), "--chat", "--prompt", "hi", "--max_new_tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("### USER: hi<|eot_id|>### ASSISTANT: ")
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "scripts/convert_hf.py", "to_hf", str(step), str(out)],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "chat_template.jinja").read_text() == custom.read_text()

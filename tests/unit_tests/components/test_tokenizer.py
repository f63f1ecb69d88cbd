"""Tests for the Llama 3 tokenizer, the bundled tokenizer it ships with, and the asset scripts."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiktoken.load import load_tiktoken_bpe

from torchtitan.components.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    LLAMA3_NUM_RESERVED_SPECIAL_TOKENS,
    Llama3Tokenizer,
    build_tokenizer,
    load_ranks,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
CORPUS_DIR = REPO_ROOT / "tests" / "assets" / "corpus"


@pytest.fixture(scope="module")
def tokenizer() -> Llama3Tokenizer:
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


def _write_ranks(path: Path, tokens: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)]
    path.write_text("".join(lines))
    return path


def _tiny_ranks() -> list[bytes]:
    """256 byte ranks and a few merges, laid out like the real Llama 3 file."""
    return [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w"]


def test_bundled_tokenizer_layout(tokenizer: Llama3Tokenizer) -> None:
    assert DEFAULT_TOKENIZER_PATH.is_file()
    assert tokenizer.vocab_size == 2048
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1792, 1793, 1796)
    assert len(tokenizer.special_tokens) == LLAMA3_NUM_RESERVED_SPECIAL_TOKENS
    assert sorted(tokenizer.special_tokens.values()) == list(range(1792, 2048))
    assert tokenizer.special_tokens["<|eot_id|>"] == 1792 + 9
    assert tokenizer.special_tokens["<|reserved_special_token_246|>"] == 2047


def test_bundled_file_is_what_tiktoken_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # An empty cache dir turns off tiktoken's by-path file cache, so it reads the file itself.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    ranks = load_tiktoken_bpe(str(DEFAULT_TOKENIZER_PATH))
    assert ranks == load_ranks(DEFAULT_TOKENIZER_PATH)
    assert all(ranks[bytes([b])] == b for b in range(256))


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "déjà vu, naïve café — 東京 🚀 Ωμέγα",
        "def f(x: int) -> int:\n\treturn x ** 2  # square\n\n\n",
        "   leading, \t\t trailing   \n \r\n  ",
        "",
    ],
)
def test_round_trip(tokenizer: Llama3Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < 1792 for i in ids)
    assert tokenizer.decode(ids) == text


def test_bos_eos(tokenizer: Llama3Tokenizer) -> None:
    plain = tokenizer.encode("hello world")
    framed = tokenizer.encode("hello world", add_bos=True, add_eos=True)
    assert framed == [tokenizer.bos_id, *plain, tokenizer.eos_id]
    assert tokenizer.encode("hello world", add_eos=True) == [*plain, tokenizer.eos_id]
    assert tokenizer.encode("", add_bos=True) == [tokenizer.bos_id]
    assert tokenizer.decode(framed) == "<|begin_of_text|>hello world<|end_of_text|>"


def test_special_token_strings_stay_text(tokenizer: Llama3Tokenizer) -> None:
    text = "a<|begin_of_text|>b<|eot_id|><|end_of_text|>"
    ids = tokenizer.encode(text)
    assert not set(ids) & set(tokenizer.special_tokens.values())
    assert tokenizer.decode(ids) == text


def test_long_inputs(tokenizer: Llama3Tokenizer) -> None:
    whitespace = "x" + " " * 100_000 + "\n" * 30_000 + "y"
    assert tokenizer.decode(tokenizer.encode(whitespace)) == whitespace
    unbroken = "ab" * 500_000  # 1M chars with no split point for the pre-tokenizer
    assert tokenizer.decode(tokenizer.encode(unbroken)) == unbroken
    prose = ("Hello world, this is text. " * 40_000)[:1_000_000]
    assert tokenizer.decode(tokenizer.encode(prose)) == prose


def test_llama3_format_file(tmp_path: Path) -> None:
    path = _write_ranks(tmp_path / "tokenizer.model", _tiny_ranks())
    tok = build_tokenizer(path)
    assert tok.num_base_tokens == 261
    assert tok.vocab_size == 261 + 256
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (261, 262, 265)
    assert tok.encode("hello world") == [259, 260, ord("o"), ord("r"), ord("l"), ord("d")]
    assert tok.decode(tok.encode("hello world", add_bos=True)) == "<|begin_of_text|>hello world"


def test_directory_layouts(tmp_path: Path) -> None:
    flat = _write_ranks(tmp_path / "flat" / "tokenizer.model", _tiny_ranks())
    hub = _write_ranks(tmp_path / "hub" / "original" / "tokenizer.model", _tiny_ranks())
    assert build_tokenizer(tmp_path / "flat").model_path == flat
    assert build_tokenizer(tmp_path / "hub").model_path == hub
    assert build_tokenizer(str(hub)).vocab_size == 517


def test_missing_path_names_the_flag(tmp_path: Path) -> None:
    for missing in (tmp_path / "nope" / "tokenizer.model", tmp_path):
        with pytest.raises(FileNotFoundError, match="--model.tokenizer_path") as info:
            build_tokenizer(missing)
        assert str(missing) in str(info.value)
        assert "download_hf_assets.py" in str(info.value)


@pytest.mark.parametrize(
    ("content", "line"),
    [
        ("AA== 0\nnot-base64! 1\n", 2),
        ("AA== 0\nAQ==\n", 2),
        ("AA== 0\nAQ== 5\n", 2),
        ("AA== 0\nAA== 1\n", 2),
    ],
)
def test_malformed_file(tmp_path: Path, content: str, line: int) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"line {line}") as info:
        build_tokenizer(path)
    assert str(path) in str(info.value)


def test_compresses_validation_corpus(tokenizer: Llama3Tokenizer) -> None:
    with open(CORPUS_DIR / "validation.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    assert num_bytes > 50_000
    assert num_tokens / num_bytes < 0.5


def test_corpus_files() -> None:
    sizes = {}
    for split in ("train", "validation"):
        with open(CORPUS_DIR / f"{split}.jsonl", encoding="utf-8") as f:
            docs = [json.loads(line) for line in f]
        assert all(set(d) == {"text"} and d["text"] for d in docs)
        sizes[split] = sum(len(d["text"]) for d in docs)
    assert sizes["train"] + sizes["validation"] >= 2_000_000
    assert (CORPUS_DIR / "README.md").is_file()


def test_download_script_help() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "download_hf_assets.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--repo_id" in result.stdout


@pytest.mark.parametrize(
    ("repo_files", "error"),
    [
        ({"original/tokenizer.model", "tokenizer.json", "tokenizer_config.json"}, None),  # Llama 3
        ({"tokenizer.json", "tokenizer_config.json"}, None),  # DeepSeek ships no ranks file
        ({"tokenizer_config.json"}, "has no original/tokenizer.model or tokenizer.json"),
    ],
)
def test_download_takes_whichever_tokenizer_a_repo_ships(tmp_path, monkeypatch, repo_files, error):
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import download_hf_assets as script
    finally:
        sys.path.pop(0)

    def fake_download(repo_id, filename, local_dir, token):
        return local_dir / filename if filename in repo_files else None

    monkeypatch.setattr(script, "_download_file", fake_download)
    if error is None:
        got = script.download_assets("owner/name", ["tokenizer"], tmp_path, None)
        assert {p.relative_to(tmp_path).as_posix() for p in got} == repo_files
    else:
        with pytest.raises(script.DownloadError, match=error):
            script.download_assets("owner/name", ["tokenizer"], tmp_path, None)


@pytest.mark.parametrize(
    ("repo_files", "error"),
    [
        ({"config.json", "model.safetensors"}, None),  # one file
        ({"config.json", "model.safetensors.index.json", "a.safetensors", "b.safetensors"}, None),
        ({"config.json", "model.safetensors.index.json", "a.safetensors"}, "names b.safetensors"),
        ({"model.safetensors"}, "no config.json"),
        ({"config.json"}, "has no model.safetensors.index.json or model.safetensors"),
    ],
)
def test_download_fetches_the_weights_and_every_shard_the_index_names(
    tmp_path, monkeypatch, repo_files, error
):
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import download_hf_assets as script
    finally:
        sys.path.pop(0)
    index = {"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "a.safetensors"}}

    def fake_download(repo_id, filename, local_dir, token):
        if filename not in repo_files:
            return None
        if filename == "model.safetensors.index.json":
            (local_dir / filename).write_text(json.dumps(index))
        return local_dir / filename

    monkeypatch.setattr(script, "_download_file", fake_download)
    if error is None:
        got = script.download_assets("owner/name", ["weights"], tmp_path, None)
        assert {p.relative_to(tmp_path).as_posix() for p in got} == repo_files
    else:
        with pytest.raises(script.DownloadError, match=error):
            script.download_assets("owner/name", ["weights"], tmp_path, None)


def test_download_without_the_hub_says_so_at_once_and_leaves_no_empty_folder(tmp_path) -> None:
    """A host that cannot resolve (``.invalid`` never does): one line, no five retries per
    file, and no folder left behind that the run made; a folder that was there stays."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env |= {"HF_ENDPOINT": "https://hub.example.invalid", "HF_HUB_OFFLINE": "0"}
    script = str(REPO_ROOT / "scripts" / "download_hf_assets.py")
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for local_dir in (tmp_path / "new" / "Llama", kept):
        result = subprocess.run(
            [sys.executable, script, "--local_dir", str(local_dir)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert result.returncode == 1
        assert "error: could not reach the Hugging Face hub (hub.example.invalid" in result.stderr
        assert "Retrying" not in result.stderr + result.stdout
    assert not (tmp_path / "new" / "Llama").exists()
    assert (kept / "notes.txt").read_text() == "mine"

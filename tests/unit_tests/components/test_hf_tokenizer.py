"""Hugging Face tokenizers: ``tokenizer.json`` read like a tiktoken file, and the bundled tiktoken
tokenizer converted to one with the same ids (``tests/assets/tokenizer_hf``)."""

from __future__ import annotations

import base64
import json
import pickle
import random
import shutil
import sys
from pathlib import Path

import pytest

from torchtitan.components.hf_tokenizer import HuggingFaceTokenizer
from torchtitan.components.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    Llama3Tokenizer,
    build_tokenizer,
)
from torchtitan.components.tokenizer_export import (
    hf_tokenizer_config,
    save_hf_tokenizer,
    tiktoken_to_hf,
)
from torchtitan.config.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
HF_ASSET = REPO_ROOT / "tests" / "assets" / "tokenizer_hf"
CORPUS_DIR = REPO_ROOT / "tests" / "assets" / "corpus"
# Text the corpus lacks: other scripts, emoji, digits, contractions, odd whitespace, and the
# names of special tokens (which stay text).
TRICKY = [
    "héllo wörld 😀 日本語 ١٢٣ 1234567 don't I'M we'LL",
    "\n\n\r\n  \t x\u00a0\u00a0y   \n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 3,
    "a" * 3000,
    "<|begin_of_text|>x<|end_of_text|> <|eot_id|>",
    "",
]


@pytest.fixture(scope="module")
def tiktoken_tokenizer() -> Llama3Tokenizer:
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def hf_tokenizer() -> HuggingFaceTokenizer:
    return build_tokenizer(HF_ASSET)


def _texts() -> list[str]:
    texts = []
    for split in ("validation.jsonl", "train.jsonl"):
        with open(CORPUS_DIR / split, encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()]
    return texts


def test_bundled_asset_is_the_conversion_of_the_bundled_tokenizer(tiktoken_tokenizer):
    """Regenerate with ``python scripts/convert_hf.py tokenizer tests/assets/tokenizer
    tests/assets/tokenizer_hf``."""
    shipped = json.loads((HF_ASSET / "tokenizer.json").read_text())
    fresh = tiktoken_to_hf(tiktoken_tokenizer)
    # What decides the ids (other tokenizers versions may add fields around them).
    for part in ("model", "pre_tokenizer", "added_tokens", "post_processor"):
        assert shipped[part] == fresh[part], part
    config = json.loads((HF_ASSET / "tokenizer_config.json").read_text())
    assert config == hf_tokenizer_config(tiktoken_tokenizer, 131072)


def test_same_ids_as_tiktoken_on_the_whole_corpus(tiktoken_tokenizer, hf_tokenizer):
    texts = _texts() + TRICKY
    assert len(texts) > 400
    for text in texts:
        want = tiktoken_tokenizer.encode(text, add_bos=True, add_eos=True)
        assert hf_tokenizer.encode(text, add_bos=True, add_eos=True) == want, text[:80]
        assert hf_tokenizer.decode(want[1:-1]) == text


def test_ids_and_sizes(tiktoken_tokenizer, hf_tokenizer):
    for name in ("vocab_size", "bos_id", "eos_id", "pad_id"):
        assert getattr(hf_tokenizer, name) == getattr(tiktoken_tokenizer, name), name
    assert (hf_tokenizer.bos_id, hf_tokenizer.eos_id, hf_tokenizer.pad_id) == (1792, 1793, 1796)
    # Special-token names in text stay text: no control token comes out of data.
    ids = hf_tokenizer.encode("<|end_of_text|>")
    assert hf_tokenizer.eos_id not in ids and len(ids) > 1


def test_transformers_loads_the_converted_files(tiktoken_tokenizer):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(HF_ASSET)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (1792, 1793, 1796)
    text = "def f(x):\n    return x ** 2  # squares"
    # transformers adds bos like Llama 3's files do (the post-processor).
    assert auto(text)["input_ids"] == tiktoken_tokenizer.encode(text, add_bos=True)
    assert auto.decode(auto(text)["input_ids"], skip_special_tokens=True) == text


def test_folder_layouts(tmp_path):
    both = tmp_path / "llama"  # a Llama 3 download has both: the ranks file wins
    (both / "original").mkdir(parents=True)
    shutil.copy(DEFAULT_TOKENIZER_PATH, both / "original" / "tokenizer.model")
    shutil.copy(HF_ASSET / "tokenizer.json", both / "tokenizer.json")
    assert isinstance(build_tokenizer(both), Llama3Tokenizer)
    assert isinstance(build_tokenizer(both / "tokenizer.json"), HuggingFaceTokenizer)
    assert isinstance(build_tokenizer(HF_ASSET), HuggingFaceTokenizer)  # json only
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.model .* or tokenizer.json in"):
        build_tokenizer(tmp_path)


def _folder(tmp_path: Path, config: dict | None) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copy(HF_ASSET / "tokenizer.json", folder / "tokenizer.json")
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_config_forms(tmp_path):
    """bos/eos as strings or AddedToken entries (DeepSeek's form); without a config, the
    common names; eos named differently from the default."""
    added = {"__type": "AddedToken", "content": "<|reserved_special_token_0|>", "lstrip": False}
    tokenizer = build_tokenizer(
        _folder(tmp_path, {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": added})
    )
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1792, 1794, None)
    shutil.rmtree(tmp_path / "hf")
    tokenizer = build_tokenizer(_folder(tmp_path, None))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1792, 1793)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"bos_token": "<s>"}, "names bos_token '<s>', which is not in tokenizer.json"),
        ({"eos_token": None, "bos_token": "<|begin_of_text|>"}, None),
    ],
)
def test_config_errors(tmp_path, config, expected):
    folder = _folder(tmp_path, config)
    if expected is None:  # null falls back to the common names
        assert build_tokenizer(folder).eos_id == 1793
        return
    with pytest.raises(ConfigError, match=expected):
        build_tokenizer(folder)


def _without(tmp_path: Path, name: str) -> Path:
    """The bundled tokenizer.json without the special token ``name`` (and no config)."""
    data = json.loads((HF_ASSET / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != name]
    data["post_processor"] = None
    folder = tmp_path / "without"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_a_vocabulary_without_bos_frames_documents_with_eos(tmp_path, tiktoken_tokenizer):
    """Qwen-style: no bos token. Documents are framed by eos on both sides (GPT-2's way)."""
    tokenizer = build_tokenizer(_without(tmp_path, "<|begin_of_text|>"))
    eos = tokenizer.eos_id
    assert tokenizer.bos_id == eos and tokenizer.decode([eos]) == "<|end_of_text|>"
    text = "print(1)"
    framed = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert framed == [eos, *tiktoken_tokenizer.encode(text), eos]


def test_a_vocabulary_without_eos_is_refused(tmp_path):
    folder = _without(tmp_path, "<|end_of_text|>")
    with pytest.raises(ConfigError, match=r"no eos_token found .* set \"eos_token\" in"):
        build_tokenizer(folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizer.json"):
        build_tokenizer(folder)


def test_saving_an_hf_tokenizer_copies_its_files(tmp_path, hf_tokenizer):
    written = save_hf_tokenizer(hf_tokenizer, tmp_path, 64)
    assert [p.read_bytes() for p in written] == [
        (HF_ASSET / "tokenizer.json").read_bytes(),
        (HF_ASSET / "tokenizer_config.json").read_bytes(),
        (HF_ASSET / "chat_template.jinja").read_bytes(),  # the template beside it
    ]
    # A run's own template (--training.chat_template) replaces it.
    (tmp_path / "own").mkdir()
    save_hf_tokenizer(hf_tokenizer, tmp_path / "own", 64, chat_template="T")
    assert (tmp_path / "own/chat_template.jinja").read_text() == "T"


def _ranks_file(tmp_path: Path, tokens: list[bytes]) -> Llama3Tokenizer:
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return Llama3Tokenizer(path)


def _assert_same_ids(tiktoken_tokenizer: Llama3Tokenizer, texts: list[str]) -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(json.dumps(tiktoken_to_hf(tiktoken_tokenizer)))
    for text in texts:
        want = tiktoken_tokenizer.encode(text)
        assert hf.encode(text, add_special_tokens=False).ids == want, text


SINGLE_BYTES = [bytes([b]) for b in range(256)]


@pytest.mark.parametrize(
    ("merged", "texts"),
    [
        # A token whose halves rank above it (Llama 3's file has ".:.:" so): tiktoken still
        # builds it from them inside a longer piece.
        ([b":.", b".:", b".:.:", b".:."], [".:.:;", "x .:.:!", ".:.:", ".:.:.:;"]),
        ([b"ab", b"bc", b"abc", b"cd", b"abcd", b"de"], ["abcde", "xabcdex", "abcdabcd"]),
    ],
)
def test_conversion_follows_tiktoken_where_halves_rank_above_the_token(tmp_path, merged, texts):
    _assert_same_ids(_ranks_file(tmp_path, SINGLE_BYTES + merged), texts)


def test_conversion_on_random_vocabularies(tmp_path):
    """Random tokens over a small alphabet in random rank order, bytes anywhere among them."""
    rng = random.Random(0)
    for _ in range(40):
        merged = set()
        while len(merged) < rng.randint(5, 40):
            merged.add(bytes(rng.choice(b"abc") for _ in range(rng.randint(2, 6))))
        tokens = SINGLE_BYTES + sorted(merged)
        rng.shuffle(tokens)
        texts = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 30))) for _ in range(30)]
        _assert_same_ids(_ranks_file(tmp_path, tokens), texts)


def test_added_tokens_stay_text_and_survive_pickling(tmp_path, tiktoken_tokenizer):
    """Also tokens added without the special flag (DeepSeek's chat tokens); a pickled copy
    (what a dataloader worker started by spawn gets) encodes alike."""
    from tokenizers import AddedToken, Tokenizer

    hf = Tokenizer.from_file(str(HF_ASSET / "tokenizer.json"))
    hf.add_tokens([AddedToken("<|User|>", special=False)])
    (tmp_path / "tokenizer.json").write_text(hf.to_str())
    tokenizer = build_tokenizer(tmp_path / "tokenizer.json")
    text = "hi <|User|> there <|end_of_text|>"
    want = tiktoken_tokenizer.encode(text)
    assert tokenizer.encode(text) == want
    assert pickle.loads(pickle.dumps(tokenizer)).encode(text) == want


def test_a_sentencepiece_model_beside_tokenizer_json_falls_back_to_it(tmp_path):
    """Llama 2, Mistral and Gemma folders: a SentencePiece tokenizer.model (not tiktoken's
    format) next to the tokenizer.json we read."""
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x0b\x00sentencepiece\xff")
    shutil.copy(HF_ASSET / "tokenizer.json", tmp_path / "tokenizer.json")
    assert isinstance(build_tokenizer(tmp_path), HuggingFaceTokenizer)
    with pytest.raises(ConfigError, match="is not a tiktoken ranks file"):
        build_tokenizer(tmp_path / "tokenizer.model")


def test_convert_script_refuses_an_hf_tokenizer(tmp_path, capsys):
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import convert_hf
    finally:
        sys.path.pop(0)
    assert convert_hf.main(["tokenizer", str(HF_ASSET), str(tmp_path / "out")]) == 2
    assert "already a Hugging Face tokenizer" in capsys.readouterr().err
    assert convert_hf.main(["tokenizer", str(DEFAULT_TOKENIZER_PATH), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "tokenizer.json").read_text()) == json.loads(
        (HF_ASSET / "tokenizer.json").read_text()
    )

"""A tokenizer written into a Hugging Face model folder (``tokenizer.json`` +
``tokenizer_config.json``), so that an export carries the tokenizer its run trained with.

:func:`tiktoken_to_hf` turns a tiktoken ranks file into the equivalent byte-level BPE
``tokenizer.json`` (the same ids: tested on the bundled corpus, on files whose tokens' halves
rank above them and on random vocabularies), which ``transformers.AutoTokenizer`` loads;
:func:`save_hf_tokenizer` converts a tiktoken tokenizer or copies a Hugging Face one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from torchtitan.components.chat_template import TEMPLATE_FILE, template_source
from torchtitan.components.hf_tokenizer import (
    HF_CONFIG_FILENAME,
    HF_TOKENIZER_FILENAME,
    HuggingFaceTokenizer,
)
from torchtitan.components.tokenizer import LLAMA3_SPLIT_PATTERN, Llama3Tokenizer

__all__ = ["hf_tokenizer_config", "save_hf_tokenizer", "tiktoken_to_hf"]


def _byte_symbols() -> list[str]:
    """The printable character that byte-level BPE files use for each byte value: printable
    Latin-1 bytes stand for themselves, the others for the code points from 256 up in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every way a token is two tokens joined, ordered by the token's rank (then by the halves'
    ranks). tiktoken merges the adjacent pair whose joined bytes have the lowest rank, whatever
    the halves' own ranks; listing every split at its token's rank gives ``tokenizers`` the same
    choice (a token's halves can rank above it in real files: Llama 3's ``.:.:``)."""
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def tiktoken_to_hf(tokenizer: Llama3Tokenizer) -> dict[str, Any]:
    """The ``tokenizer.json`` content of a tiktoken tokenizer: its ranks as a byte-level BPE
    vocabulary, every split of each token into two tokens as a merge ranked by the token's
    rank (:func:`_merges`), the Llama 3 split pattern and special tokens, and a post-processor
    that starts every sequence with bos (what ``transformers`` does for Llama 3)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    ranks = tokenizer.mergeable_ranks
    symbols = _byte_symbols()

    def text(token: bytes) -> str:
        return "".join(symbols[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{tokenizer.model_path}: no token for the single byte(s) {missing[:5]}")
    merges = [(text(left), text(right)) for left, right in _merges(ranks)]
    # ignore_merges: a pre-token that is a token is used whole, as tiktoken does.
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=True)
    hf = Tokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    hf.add_special_tokens(
        [AddedToken(name, special=True, normalized=False) for name, _ in specials]
    )
    added = hf.get_vocab(with_added_tokens=True)
    wrong = [(name, i) for name, i in specials if added.get(name) != i]
    if wrong:  # add_special_tokens numbers them after the vocabulary: ours are there already
        raise ValueError(f"special tokens numbered differently: {wrong[:3]}")
    bos = tokenizer.token_name(tokenizer.bos_id)
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tokenizer.bos_id)],
    )
    return json.loads(hf.to_str())


def hf_tokenizer_config(
    tokenizer: Llama3Tokenizer | HuggingFaceTokenizer, model_max_length: int
) -> dict[str, Any]:
    """A ``tokenizer_config.json`` naming ``tokenizer``'s bos, eos and pad tokens, which
    ``transformers`` reads from it (ours may come from common names, not a file)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.token_name(tokenizer.bos_id),
        "eos_token": tokenizer.token_name(tokenizer.eos_id),
    }
    if tokenizer.pad_id is not None:
        config["pad_token"] = tokenizer.token_name(tokenizer.pad_id)
    return config | {"model_max_length": model_max_length, "clean_up_tokenization_spaces": False}


def save_hf_tokenizer(
    tokenizer: Llama3Tokenizer | HuggingFaceTokenizer,
    folder: str | os.PathLike,
    model_max_length: int,
    *,
    chat_template: str | None = None,
) -> list[Path]:
    """Write `tokenizer` into a Hugging Face model folder: a ``tokenizer.json`` tokenizer's own
    files copied, a tiktoken one converted; ``chat_template`` (else the tokenizer's own: the
    ``chat_template.jinja`` beside it, or for a tiktoken file also a model folder's
    ``tokenizer_config.json`` one, which its conversion does not carry) as
    ``chat_template.jinja``, which ``transformers`` reads before the one in
    ``tokenizer_config.json``. Returns the files written."""
    folder = Path(folder)
    files = [folder / HF_TOKENIZER_FILENAME, folder / HF_CONFIG_FILENAME]
    if chat_template is None:
        if isinstance(tokenizer, HuggingFaceTokenizer):
            beside = tokenizer.path.with_name(TEMPLATE_FILE)
            chat_template = beside.read_text(encoding="utf-8") if beside.is_file() else None
        else:
            found = template_source(Path(tokenizer.model_path).parent, None)
            chat_template = found[0] if found else None
    if chat_template is not None:
        files.append(folder / TEMPLATE_FILE)
        files[2].write_text(chat_template, encoding="utf-8")
    if isinstance(tokenizer, HuggingFaceTokenizer):
        shutil.copyfile(tokenizer.path, files[0])
        if tokenizer.config_path.is_file():
            shutil.copyfile(tokenizer.config_path, files[1])
            return files
    else:
        data = tiktoken_to_hf(tokenizer)
        files[0].write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n")
    config = hf_tokenizer_config(tokenizer, model_max_length)
    files[1].write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    return files

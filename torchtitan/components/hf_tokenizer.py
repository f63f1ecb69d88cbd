"""Hugging Face tokenizers (``tokenizer.json``) in and out.

In: :class:`HuggingFaceTokenizer` reads the ``tokenizer.json`` that Hugging Face model folders
ship (DeepSeek-V3 ships nothing else; Llama 3 ships it next to ``original/tokenizer.model``),
with the ``bos_token`` / ``eos_token`` of the ``tokenizer_config.json`` beside it. It encodes like
:class:`~torchtitan.components.tokenizer.Llama3Tokenizer`: no special tokens added unless asked,
and special-token strings inside the text stay text.

Out: :func:`tiktoken_to_hf` turns a tiktoken ranks file into the equivalent byte-level BPE
``tokenizer.json`` (the same ids for every text), so a Hugging Face export of a run trained on a
``tokenizer.model`` carries a tokenizer that ``transformers.AutoTokenizer`` loads
(:func:`save_hf_tokenizer`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchtitan.components.tokenizer import (
    HF_TOKENIZER_FILENAME,
    LLAMA3_SPLIT_PATTERN,
    Llama3Tokenizer,
)
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger

__all__ = [
    "HF_CONFIG_FILENAME",
    "HF_TOKENIZER_FILENAME",
    "HuggingFaceTokenizer",
    "save_hf_tokenizer",
    "tiktoken_to_hf",
]

HF_CONFIG_FILENAME = "tokenizer_config.json"

# Where tokenizer_config.json names no bos/eos token: the names the common families use.
_BOS_NAMES = ("<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "<s>", "<bos>")
_EOS_NAMES = ("<|end_of_text|>", "<｜end▁of▁sentence｜>", "</s>", "<eos>", "<|endoftext|>")


def _token_name(value: Any) -> str | None:
    """A tokenizer_config.json token entry: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library.

    Args:
        path: the ``tokenizer.json`` file; ``tokenizer_config.json`` next to it, if present,
            names the bos, eos and pad tokens.

    Raises:
        ConfigError: the file is not a tokenizer the library reads, or it has no eos token
            (each packed document ends with eos). A vocabulary without bos (Qwen's, say) frames
            documents with eos on both sides, as GPT-2's does (``bos_id == eos_id``).
    """

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer

        self.path = Path(path)
        where = f"--model.tokenizer_path={self.path}"
        try:
            self._model = Tokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust library raises plain Exception subclasses
            first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            raise ConfigError(f"{where}: not a Hugging Face tokenizer.json ({first})") from None
        # Special-token strings in training text are encoded as ordinary text, as the tiktoken
        # path does: data can never inject control tokens.
        self._model.encode_special_tokens = True
        self.config_path = self.path.with_name(HF_CONFIG_FILENAME)
        config: dict[str, Any] = {}
        if self.config_path.is_file():
            try:
                config = json.loads(self.config_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise ConfigError(f"{self.config_path}: not valid JSON ({e})") from None
        vocab = self._model.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1
        eos_id = self._special_id(vocab, config, "eos_token", _EOS_NAMES, where)
        if eos_id is None:
            raise ConfigError(
                f"{where}: no eos_token found (not in {self.config_path.name}, and none of "
                f"{', '.join(_EOS_NAMES)} in the vocabulary); every packed document ends with "
                f'eos: set "eos_token" in {self.config_path}'
            )
        self.eos_id: int = eos_id
        bos_id = self._special_id(vocab, config, "bos_token", _BOS_NAMES, where)
        if bos_id is None:
            logger.info(
                f"Tokenizer {self.path} has no bos token: documents are framed by its eos "
                f"({self._model.id_to_token(eos_id)}) on both sides"
            )
        self.bos_id: int = eos_id if bos_id is None else bos_id
        pad = _token_name(config.get("pad_token"))
        self.pad_id: int | None = vocab.get(pad) if pad else None

    def _special_id(
        self, vocab: dict[str, int], config: dict, key: str, names: Sequence[str], where: str
    ) -> int | None:
        """The id of ``config[key]`` (refused if not in the vocabulary), else of the first of
        ``names`` in the vocabulary, else ``None``."""
        name = _token_name(config.get(key))
        if name is not None:
            if name not in vocab:
                raise ConfigError(
                    f"{where}: {self.config_path.name} names {key} {name!r}, which is not in "
                    f"{self.path.name}"
                )
            return vocab[name]
        return next((vocab[n] for n in names if n in vocab), None)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by bos/eos (the file's own post-processor, such
        as Llama 3's automatic bos, is not applied)."""
        ids = self._model.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token `ids`; special ids decode to their names."""
        return self._model.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


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


def _split_below(token: bytes, ranks: dict[bytes, int], limit: int) -> list[bytes]:
    """`token`'s bytes merged as tiktoken merges them with only the ranks below `limit`: the
    two halves whose merge made the token (more parts: no merge makes it)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], limit)
            if rank < best:
                best, at = rank, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def tiktoken_to_hf(tokenizer: Llama3Tokenizer) -> dict[str, Any]:
    """The ``tokenizer.json`` content of a tiktoken tokenizer: its ranks as a byte-level BPE
    vocabulary, each token's merge ranked by the token's rank, the Llama 3 split pattern and
    special tokens, and a post-processor that starts every sequence with bos (what
    ``transformers`` does for Llama 3). Encodes every text to the same ids."""
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
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = _split_below(token, ranks, rank)
            if len(parts) == 2:  # a token no merge makes is still used whole (ignore_merges)
                merges.append((text(parts[0]), text(parts[1])))
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
    bos = _name_of(tokenizer.special_tokens, tokenizer.bos_id)
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tokenizer.bos_id)],
    )
    return json.loads(hf.to_str())


def _name_of(special_tokens: dict[str, int], token_id: int) -> str:
    return next(name for name, i in special_tokens.items() if i == token_id)


def hf_tokenizer_config(tokenizer: Llama3Tokenizer, model_max_length: int) -> dict[str, Any]:
    """A ``tokenizer_config.json`` for :func:`tiktoken_to_hf`'s file (``transformers`` reads the
    bos, eos and pad tokens from it)."""
    names = tokenizer.special_tokens
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _name_of(names, tokenizer.bos_id),
        "eos_token": _name_of(names, tokenizer.eos_id),
        "pad_token": _name_of(names, tokenizer.pad_id),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }


def save_hf_tokenizer(
    tokenizer: Llama3Tokenizer | HuggingFaceTokenizer,
    folder: str | os.PathLike,
    model_max_length: int,
) -> list[Path]:
    """Write `tokenizer` into a Hugging Face model folder: a ``tokenizer.json`` tokenizer's own
    files copied, a tiktoken one converted. Returns the files written."""
    folder = Path(folder)
    written = [folder / HF_TOKENIZER_FILENAME, folder / HF_CONFIG_FILENAME]
    if isinstance(tokenizer, HuggingFaceTokenizer):
        shutil.copyfile(tokenizer.path, written[0])
        if tokenizer.config_path.is_file():
            shutil.copyfile(tokenizer.config_path, written[1])
        else:
            written.pop()
        return written
    written[0].write_text(
        json.dumps(tiktoken_to_hf(tokenizer), ensure_ascii=False, indent=2) + "\n"
    )
    config = hf_tokenizer_config(tokenizer, model_max_length)
    written[1].write_text(json.dumps(config, indent=2) + "\n")
    return written

"""Hugging Face tokenizers: :class:`HuggingFaceTokenizer` reads the ``tokenizer.json`` that
Hugging Face model folders ship (DeepSeek-V3 and Qwen3 ship nothing else; Llama 3 ships it next
to ``original/tokenizer.model``), with the ``bos_token`` / ``eos_token`` of the
``tokenizer_config.json`` beside it. It encodes like
:class:`~torchtitan.components.tokenizer.Llama3Tokenizer`: no special tokens added unless asked,
and the strings of special and added tokens inside the text stay text. Writing one:
``torchtitan.components.tokenizer_export``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger

__all__ = ["HF_CONFIG_FILENAME", "HF_TOKENIZER_FILENAME", "HuggingFaceTokenizer"]

HF_TOKENIZER_FILENAME = "tokenizer.json"
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
        self._treat_added_tokens_as_text()
        self.config_path = self.path.with_name(HF_CONFIG_FILENAME)
        config: dict[str, Any] = {}
        if self.config_path.is_file():
            try:
                config = json.loads(self.config_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise ConfigError(f"{self.config_path}: not valid JSON ({e})") from None
            if not isinstance(config, dict):
                raise ConfigError(f"{self.config_path}: not a JSON object")
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
        self.has_bos = bos_id is not None
        """Whether the vocabulary has a bos token of its own (chat templates see none else)."""
        pad = _token_name(config.get("pad_token"))
        self.pad_id: int | None = vocab.get(pad) if pad else None

    def _treat_added_tokens_as_text(self) -> None:
        """Token strings in training text are encoded as ordinary text, as the tiktoken path
        does, so data can never inject a control token. ``encode_special_tokens`` does that
        for added tokens marked special only; the others (DeepSeek's chat and tool tokens,
        say) are marked special first (ids unchanged; decoding keeps every token)."""
        from tokenizers import AddedToken

        plain = [t for t in self._model.get_added_tokens_decoder().values() if not t.special]
        if plain:
            self._model.add_special_tokens(
                [
                    AddedToken(
                        t.content,
                        single_word=t.single_word,
                        lstrip=t.lstrip,
                        rstrip=t.rstrip,
                        normalized=t.normalized,
                        special=True,
                    )
                    for t in plain
                ]  # fmt: skip
            )
        self._model.encode_special_tokens = True

    def __reduce__(self):
        # The library's own pickling drops encode_special_tokens (dataloader workers started
        # by spawn would get control tokens from data): rebuild from the file instead.
        return (type(self), (self.path,))

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

    def encode_template(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of text a chat template wrote, where the strings of special and added
        tokens are those tokens (as ``transformers`` encodes a rendered template), and the
        characters ``[start, end)`` each token covers."""
        self._model.encode_special_tokens = False
        try:
            encoding = self._model.encode(text, add_special_tokens=False)
        finally:
            self._model.encode_special_tokens = True
        return list(encoding.ids), [(start, max(end, start + 1)) for start, end in encoding.offsets]

    def token_name(self, token_id: int) -> str:
        """The string of one token id (a special token's name)."""
        return self._model.id_to_token(token_id)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token `ids`; special ids decode to their names."""
        return self._model.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"

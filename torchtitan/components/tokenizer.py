"""The Llama 3 tokenizer: tiktoken byte-level BPE read from a `tokenizer.model` ranks file.

A `tokenizer.model` file holds one line per mergeable token, ``<base64 of the token bytes> <rank>``,
with ranks 0..N-1. The 256 Llama 3 special tokens are not in the file; they get the ids N..N+255.
The same class reads the real Llama 3 file (N = 128000) and the small one this project trains
with ``scripts/train_tokenizer.py`` (N = 1792), bundled at ``tests/assets/tokenizer``.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken

from torchtitan.components.hf_tokenizer import HF_TOKENIZER_FILENAME, HuggingFaceTokenizer
from torchtitan.config.errors import ConfigError

__all__ = [
    "DEFAULT_TOKENIZER_PATH",
    "LLAMA3_NUM_RESERVED_SPECIAL_TOKENS",
    "LLAMA3_SPLIT_PATTERN",
    "Llama3Tokenizer",
    "build_tokenizer",
    "find_tokenizer_file",
    "missing_tokenizer_message",
    "llama3_special_tokens",
    "load_ranks",
]

# The pre-tokenizer regex of Llama 3: contractions, letter runs (with one leading non-letter),
# digit groups of at most three, punctuation runs, newlines, and whitespace. BPE merges never
# cross the boundaries of these pieces. Training (scripts/train_tokenizer.py) imports it from here.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

LLAMA3_NUM_RESERVED_SPECIAL_TOKENS = 256

# The named special tokens of Llama 3.1, in id order; reserved tokens fill the rest of the 256.
_LLAMA3_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)

# tiktoken's regex and BPE slow down badly on huge inputs and on long runs that the split
# pattern cannot break up, so encode() works on bounded pieces (the limits Llama 3 uses).
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_RUN_RE = re.compile(r"\s+|\S+")

_TOKENIZER_FILENAME = "tokenizer.model"
_REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_PATH = _REPO_ROOT / "tests" / "assets" / "tokenizer" / _TOKENIZER_FILENAME


def llama3_special_tokens(num_base_tokens: int) -> dict[str, int]:
    """The 256 Llama 3 special tokens mapped to ids ``num_base_tokens .. num_base_tokens + 255``."""
    num_reserved = LLAMA3_NUM_RESERVED_SPECIAL_TOKENS - len(_LLAMA3_NAMED_SPECIAL_TOKENS)
    names = list(_LLAMA3_NAMED_SPECIAL_TOKENS)
    names += [f"<|reserved_special_token_{2 + i}|>" for i in range(num_reserved)]
    return {name: num_base_tokens + i for i, name in enumerate(names)}


def load_ranks(model_path: str | os.PathLike) -> dict[bytes, int]:
    """Read a `tokenizer.model` ranks file into ``{token bytes: rank}``.

    This is the format `tiktoken.load.load_tiktoken_bpe` reads. We parse it here instead because
    that function caches files by path in a temp directory and would return stale contents after
    the file at a path changes (a retrained tokenizer, a reused tmp dir). Raises ValueError naming
    the file and line for a malformed line, a duplicate token, or ranks that are not 0..N-1.
    """
    ranks: dict[bytes, int] = {}
    with open(model_path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            fields = line.split()
            try:
                if len(fields) != 2:
                    raise ValueError("expected two fields")
                token = base64.b64decode(fields[0], validate=True)
                rank = int(fields[1])
            except (ValueError, binascii.Error) as e:
                raise ValueError(
                    f"{model_path}, line {line_no}: malformed tokenizer line {line[:80]!r} ({e}); "
                    "expected '<base64 token bytes> <rank>' as in a Llama 3 tokenizer.model"
                ) from None
            if token in ranks:
                raise ValueError(
                    f"{model_path}, line {line_no}: token {token!r} already has rank "
                    f"{ranks[token]}; each token must appear once"
                )
            if rank != len(ranks):
                raise ValueError(
                    f"{model_path}, line {line_no}: rank {rank} out of order, expected "
                    f"{len(ranks)}; ranks must be 0..N-1 in file order"
                )
            ranks[token] = rank
    if not ranks:
        raise ValueError(f"{model_path}: tokenizer file has no tokens")
    return ranks


def _bounded_pieces(text: str) -> Iterator[str]:
    """Split `text` into consecutive pieces of at most 400k chars, none holding a run of more
    than 25k whitespace or non-whitespace chars. The pieces concatenate back to `text`."""
    for chunk_start in range(0, len(text), _MAX_ENCODE_CHARS):
        chunk = text[chunk_start : chunk_start + _MAX_ENCODE_CHARS]
        piece_start = 0
        for run in _RUN_RE.finditer(chunk):
            for cut in range(run.start() + _MAX_RUN_CHARS, run.end(), _MAX_RUN_CHARS):
                yield chunk[piece_start:cut]
                piece_start = cut
        yield chunk[piece_start:]


class Llama3Tokenizer:
    """tiktoken BPE over a Llama 3 `tokenizer.model` file (base64 token + rank per line), with the
    Llama 3 special tokens appended after the base ranks.

    Args:
        model_path: path of the `tokenizer.model` file itself (see `build_tokenizer` for
            directories).
    """

    def __init__(self, model_path: str | os.PathLike):
        self.model_path = Path(model_path)
        mergeable_ranks = load_ranks(self.model_path)
        self.mergeable_ranks: dict[bytes, int] = mergeable_ranks
        self.num_base_tokens = len(mergeable_ranks)
        self.special_tokens: dict[str, int] = llama3_special_tokens(self.num_base_tokens)
        self.vocab_size: int = self.num_base_tokens + len(self.special_tokens)
        self._model = tiktoken.Encoding(
            name=self.model_path.name,
            pat_str=LLAMA3_SPLIT_PATTERN,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
            explicit_n_vocab=self.vocab_size,
        )
        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.pad_id: int = self.special_tokens["<|finetune_right_pad_id|>"]

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by bos/eos.

        Special-token strings inside `text` (such as ``<|eot_id|>``) are encoded as ordinary text,
        so training data can never inject control tokens. Inputs of any length are accepted.
        """
        ids = [self.bos_id] if add_bos else []
        for piece in _bounded_pieces(text):
            ids.extend(self._model.encode(piece, allowed_special=set(), disallowed_special=()))
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_template(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of text a chat template wrote, where special-token strings (such as
        ``<|eot_id|>``) are the special tokens, and the characters ``[start, end)`` each token
        covers (the byte tokens of one character all cover it)."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        offset = 0
        for piece in _bounded_pieces(text):
            piece_ids = self._model.encode(piece, allowed_special="all")
            _, starts = self._model.decode_with_offsets(piece_ids)
            ends = starts[1:] + [len(piece)]
            ids.extend(piece_ids)
            spans.extend(
                (offset + a, offset + max(b, a + 1)) for a, b in zip(starts, ends, strict=True)
            )
            offset += len(piece)
        return ids, spans

    def token_name(self, token_id: int) -> str:
        """The string of one token id (a special token's name)."""
        return self._model.decode([token_id])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token `ids`; special ids decode to their names, invalid UTF-8 to U+FFFD."""
        return self._model.decode(list(ids))

    def __repr__(self) -> str:
        return f"Llama3Tokenizer(model_path={str(self.model_path)!r}, vocab_size={self.vocab_size})"


def find_tokenizer_file(tokenizer_path: str | os.PathLike) -> Path | None:
    """The file ``--model.tokenizer_path`` names: the path itself if it is a file, else in the
    directory a tiktoken ``tokenizer.model`` (directly or in ``original/``, the Hugging Face
    Llama 3 layout), else a Hugging Face ``tokenizer.json`` (DeepSeek-V3's only format)."""
    path = Path(tokenizer_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for candidate in tokenizer_candidates(path):
            if candidate.is_file():
                return candidate
    return None


def tokenizer_candidates(directory: Path) -> tuple[Path, ...]:
    """Where :func:`find_tokenizer_file` looks in a directory, in order."""
    return (
        directory / _TOKENIZER_FILENAME,
        directory / "original" / _TOKENIZER_FILENAME,
        directory / HF_TOKENIZER_FILENAME,
    )


def missing_tokenizer_message(flag_value: str | os.PathLike, path: Path) -> str:
    """One line for a ``--model.tokenizer_path`` with no tokenizer file: what was looked for
    and how to get one."""
    where = (
        f"no {_TOKENIZER_FILENAME} (nor original/{_TOKENIZER_FILENAME}) or "
        f"{HF_TOKENIZER_FILENAME} in {path}"
        if path.is_dir()
        else f"{path} does not exist"
    )
    return (
        f"--model.tokenizer_path={flag_value}: {where}; download the model's tokenizer with "
        "`python scripts/download_hf_assets.py --repo_id OWNER/NAME --assets tokenizer` (the "
        f"repos of each config: docs/data.md#tokenizer) or use the bundled "
        f"{DEFAULT_TOKENIZER_PATH.parent.relative_to(_REPO_ROOT)}"
    )


def build_tokenizer(tokenizer_path: str | os.PathLike) -> Llama3Tokenizer | HuggingFaceTokenizer:
    """Load the tokenizer named by ``--model.tokenizer_path``.

    Args:
        tokenizer_path: a `tokenizer.model` (tiktoken ranks) or `tokenizer.json` (Hugging Face)
            file, or a directory holding one (see :func:`find_tokenizer_file`).

    Raises:
        FileNotFoundError: no tokenizer file at or under `tokenizer_path`.
        ConfigError: the file is not a valid tokenizer of its format.
    """
    path = Path(tokenizer_path).expanduser()
    model_file = find_tokenizer_file(path)
    if model_file is None:
        raise FileNotFoundError(missing_tokenizer_message(tokenizer_path, path))
    if model_file.suffix == ".json":
        return HuggingFaceTokenizer(model_file)
    try:
        return Llama3Tokenizer(model_file)
    except (ValueError, UnicodeDecodeError) as e:
        beside = model_file.with_name(HF_TOKENIZER_FILENAME)
        if path.is_dir() and beside.is_file():
            # A SentencePiece tokenizer.model (Llama 2, Mistral, Gemma) next to the folder's
            # tokenizer.json: the latter is the one we read.
            return HuggingFaceTokenizer(beside)
        raise ConfigError(
            f"--model.tokenizer_path={tokenizer_path}: {model_file} is not a tiktoken ranks file "
            f"(the Llama 3 tokenizer.model format): {str(e).splitlines()[0][:160]}"
        ) from None

"""Pre-tokenized data on disk (``--training.dataset tokens``): a folder of token shards that
``scripts/pretokenize.py`` writes once and every run memory-maps.

A folder holds ``tokens-NNNNN.bin`` files, each the token ids of whole documents back to back
(little-endian ``uint16`` where the vocabulary fits, else ``uint32``), every document framed by
the tokenizer's bos and eos exactly as the text loader frames it, and ``meta.json`` naming the
shards (tokens, documents, CRC-32 each), the tokenizer (its ids and a fingerprint of how it
encodes) and the source. ``meta.json`` is written last and the folder renamed into place, so a
folder with one is complete. Torch-free: the launch pre-flight opens folders with it.
"""

import dataclasses
import hashlib
import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy

from torchtitan.config.errors import ConfigError

FORMAT = "torchtitan-tokens"
VERSION = 1
META = "meta.json"
_LITTLE = {"uint16": "<u2", "uint32": "<u4"}

# What the fingerprint encodes: prose, code, numbers, runs of spaces, tabs and newlines,
# accents, other scripts, emoji, and a special token's name (read as text). Two tokenizers that
# encode all of it alike, with the same vocabulary size and bos/eos, are taken as one.
_PROBE = (
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? 1234567890 0x7f\n"
    "def f(x: int) -> list[int]:\n    return [i ** 2 for i in range(x)]  # squares\n\n"
    "\tTabs,    runs of spaces,\r\n\n\nand blank lines.  caf\u00e9 na\u00efve Stra\u00dfe \u00f8re\n"
    "\u0391\u03b8\u03ae\u03bd\u03b1 \u041c\u043e\u0441\u043a\u0432\u0430 \u4e2d\u6587\u5b57"
    "\u7b26 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
    "\U0001f642\U0001f680 <|begin_of_text|> </s> <s> " + "=" * 40 + " aaaaaaaaaaaaaaaaaaaaaa\n"
)


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A digest of how ``tokenizer`` encodes (a fixed text of many kinds, framed by its bos and
    eos) and of its vocabulary size: equal for one tokenizer in either file format
    (``tokenizer.model`` or its ``tokenizer.json``), different for different vocabularies."""
    ids = tokenizer.encode(_PROBE, add_bos=True, add_eos=True)
    described = json.dumps([tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, ids])
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def tokenizer_file(tokenizer: Any) -> str:
    """The file a tokenizer was read from, for messages (tiktoken's ``model_path``, the
    Hugging Face reader's ``path``)."""
    return str(getattr(tokenizer, "model_path", None) or getattr(tokenizer, "path", tokenizer))


def dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id of a ``vocab_size`` vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclasses.dataclass(frozen=True)
class Shard:
    file: str
    tokens: int
    documents: int
    crc32: int


@dataclasses.dataclass(frozen=True)
class TokenFolder:
    """An opened folder: its description, checked against the shard files' sizes."""

    path: Path
    dtype: str
    shards: tuple[Shard, ...]
    tokenizer: dict[str, Any]
    """``vocab_size``, ``bos_id``, ``eos_id``, ``fingerprint``, ``path`` (as it was given)."""
    max_token_id: int
    source: dict[str, Any]
    label: str
    """What named the folder, for messages (``--training.dataset_path PATH``)."""

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def identity(self) -> str:
        """What a resumed position is valid for: the shards' contents (their CRCs and sizes)."""
        parts = ",".join(f"{s.tokens}:{s.crc32:08x}" for s in self.shards)
        return hashlib.sha256(parts.encode()).hexdigest()[:16]

    def array(self, index: int) -> numpy.ndarray:
        """Shard ``index`` memory-mapped read-only (an empty shard as an empty array)."""
        shard, dtype = self.shards[index], _LITTLE[self.dtype]
        if not shard.tokens:
            return numpy.zeros(0, dtype=dtype)
        return numpy.memmap(self.path / shard.file, dtype=dtype, mode="r")

    def arrays(self) -> list[numpy.ndarray]:
        """Every shard, memory-mapped, in order."""
        return [self.array(i) for i in range(len(self.shards))]

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Refuse in one line a run whose tokenizer is not the one these tokens were made with
        (its ids would mean other text)."""
        made = self.tokenizer
        if tokenizer_fingerprint(tokenizer) == made.get("fingerprint"):
            return
        ids = (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id)
        saved = (made.get("vocab_size"), made.get("bos_id"), made.get("eos_id"))
        why = (
            f"{saved[0]} tokens, bos {saved[1]}, eos {saved[2]} there; {ids[0]}, {ids[1]}, "
            f"{ids[2]} here"
            if ids != saved
            else "it encodes text differently"
        )
        raise ConfigError(
            f"{self.label}: made with the tokenizer {made.get('path')}, and "
            f"--model.tokenizer_path {tokenizer_file(tokenizer)} is another ({why}); pass the "
            "tokenizer "
            "it was made with, or pre-tokenize the data again with this one "
            "(scripts/pretokenize.py)"
        )


def open_folder(path: str | os.PathLike, *, given: str | None = None) -> TokenFolder:
    """Open a folder written by :class:`ShardWriter`; a missing or damaged part is refused in
    one line naming the file (sizes are checked here; contents by :func:`verify`). ``given``:
    what named the folder, for messages (default ``--training.dataset_path PATH``)."""
    folder = Path(path)
    where = given or f"--training.dataset_path {path}"
    meta_file = folder / META
    if not meta_file.is_file():
        partial = Path(f"{folder}.partial")
        hint = (
            f"; {partial} is an unfinished scripts/pretokenize.py run's" if partial.exists() else ""
        )
        what = f"{folder} does not exist" if not folder.exists() else f"no {META} in it"
        raise ConfigError(
            f"{where}: {what}, so no pre-tokenized data is there{hint}; write it with "
            f"`python scripts/pretokenize.py --out {path}` (docs/data.md#pre-tokenized-data)"
        )
    try:
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {FORMAT!r}")
        if meta.get("version") != VERSION:
            raise ValueError(f"version {meta.get('version')!r}; this torchtitan reads {VERSION}")
        dtype = meta["dtype"]
        if dtype not in _LITTLE:
            raise ValueError(f"dtype {dtype!r}")
        shards = tuple(
            Shard(s["file"], int(s["tokens"]), int(s["documents"]), int(s["crc32"]))
            for s in meta["shards"]
        )
        tokenizer, max_id = dict(meta["tokenizer"]), int(meta["max_token_id"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{where}: {meta_file} is not a pre-tokenized folder's ({e})") from None
    itemsize = numpy.dtype(_LITTLE[dtype]).itemsize
    for shard in shards:
        file = folder / shard.file
        if not file.is_file():
            raise ConfigError(f"{where}: {file} is missing; pre-tokenize the data again")
        size = file.stat().st_size
        if size != shard.tokens * itemsize:
            raise ConfigError(
                f"{where}: {file} holds {size} bytes, {META} says {shard.tokens} tokens of "
                f"{itemsize} bytes ({shard.tokens * itemsize}); it was cut or changed: "
                "pre-tokenize the data again"
            )
    source = dict(meta.get("source", {}))
    return TokenFolder(folder, dtype, shards, tokenizer, max_id, source, where)


def verify(folder: TokenFolder) -> list[str]:
    """Each shard whose contents do not match its CRC-32, one line each (empty: all sound).
    Reads every byte, so it is a separate pass (``scripts/pretokenize.py --verify``)."""
    bad = []
    for shard in folder.shards:
        crc = 0
        with open(folder.path / shard.file, "rb") as f:
            while block := f.read(1 << 24):
                crc = zlib.crc32(block, crc)
        if crc != shard.crc32:
            bad.append(
                f"{folder.path / shard.file}: CRC-32 {crc:08x}, {META} says {shard.crc32:08x}"
            )
    return bad


class ShardWriter:
    """Writes documents' token ids into ``folder`` (which must not exist): shards of whole
    documents, a new one once a shard holds ``shard_tokens`` or more; ``close`` writes
    ``meta.json``. Writing goes to ``<folder>.partial``, renamed to ``folder`` by ``close``, so
    an interrupted run leaves no folder that looks complete."""

    def __init__(self, folder: str | os.PathLike, *, vocab_size: int, shard_tokens: int):
        self.folder = Path(folder)
        self.partial = Path(f"{self.folder}.partial")
        for taken in (self.folder, self.partial):
            if taken.exists():
                raise ConfigError(
                    f"--out {folder}: {taken} exists; nothing is overwritten: remove it or "
                    "choose another --out"
                )
        if shard_tokens < 1:
            raise ConfigError(f"--shard_tokens {shard_tokens} must be positive")
        self.partial.mkdir(parents=True)
        self.dtype = dtype_for(vocab_size)
        self._vocab_size = vocab_size
        self._shard_tokens = shard_tokens
        self._shards: list[Shard] = []
        self._file: Any = None
        self._current = [0, 0, 0]  # tokens, documents, crc32 of the open shard
        self.max_token_id = -1

    def add(self, ids: Iterable[int] | numpy.ndarray, lengths: Iterable[int]) -> None:
        """Append whole documents: their ids back to back, and each one's length."""
        data = numpy.asarray(ids, dtype=numpy.int64)
        ends = numpy.cumsum(numpy.asarray(lengths, dtype=numpy.int64))
        if (ends[-1] if ends.size else 0) != data.size:
            raise ValueError(f"{data.size} ids, but the lengths add up to {ends[-1:]}")
        if data.size:
            top, low = int(data.max()), int(data.min())
            if top >= self._vocab_size or low < 0:
                bad = top if top >= self._vocab_size else low
                raise ValueError(f"token id {bad} outside a vocabulary of {self._vocab_size}")
            self.max_token_id = max(self.max_token_id, top)
        done = 0  # documents written
        while done < ends.size:
            if self._file is None:
                name = f"tokens-{len(self._shards):05d}.bin"
                self._file = open(self.partial / name, "wb")  # noqa: SIM115 (see _end_shard)
                self._current = [0, 0, 0]
            # The documents up to the first that fills the shard, or all that are left.
            room = self._shard_tokens - self._current[0]
            first = int(ends[done - 1]) if done else 0
            last = min(int(numpy.searchsorted(ends, first + room, side="left")), ends.size - 1)
            block = data[first : int(ends[last])].astype(_LITTLE[self.dtype]).tobytes()
            self._file.write(block)
            tokens, documents, crc = self._current
            count = last + 1 - done
            size = int(ends[last]) - first
            self._current = [tokens + size, documents + count, zlib.crc32(block, crc)]
            done = last + 1
            if self._current[0] >= self._shard_tokens:
                self._end_shard()

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self._shards) + (self._current[0] if self._file else 0)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self._shards) + (self._current[1] if self._file else 0)

    def _end_shard(self) -> None:
        self._file.close()
        tokens, documents, crc = self._current
        self._shards.append(Shard(Path(self._file.name).name, tokens, documents, crc))
        self._file = None

    def close(self, *, tokenizer: dict[str, Any], source: dict[str, Any]) -> TokenFolder:
        """Finish the last shard, write ``meta.json`` and move the folder into place."""
        if self._file is not None:
            self._end_shard()
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "tokens": sum(s.tokens for s in self._shards),
            "documents": sum(s.documents for s in self._shards),
            "max_token_id": self.max_token_id,
            "tokenizer": tokenizer,
            "source": source,
            "shards": [dataclasses.asdict(s) for s in self._shards],
        }
        (self.partial / META).write_text(json.dumps(meta, indent=1) + "\n")
        os.rename(self.partial, self.folder)
        return open_folder(self.folder, given=str(self.folder))

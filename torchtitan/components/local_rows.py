"""Local JSON Lines, JSON and text files read straight into memory, without ``datasets``.

``datasets`` costs each rank of each launch over half a second to import (with pandas and
pyarrow) and writes an Arrow cache of every local file under ``~/.cache/huggingface``, which
every rank of every node then opens and locks. Files small enough to hold in memory
(``IN_MEMORY_BYTES`` in all, uncompressed or gzip/bz2/xz) are read here instead, as the same
rows ``datasets.load_dataset`` gives: JSON Lines one object a line; a JSON file one list of
objects (or of strings: ``text`` rows) or JSON Lines; a text file one ``text`` row per
paragraph (blank-line separated). Larger files, zstd files and parquet stay with
``datasets``, memory-mapped.
"""

from __future__ import annotations

import bz2
import codecs
import dataclasses
import gzip
import json
import lzma
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torchtitan.components.token_windows import contiguous_block
from torchtitan.config.errors import ConfigError

IN_MEMORY_BYTES = 64 * 2**20
"""Files larger than this on disk in all go through ``datasets`` (memory-mapped, not held
per rank)."""

_OPEN = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


@dataclasses.dataclass(frozen=True)
class Column:
    """A field of the rows: ``dtype`` as ``datasets`` names a column of one JSON type
    (``string``, ``int64``, ``float64``, ``bool``); ``None`` for nested or mixed values, which
    each row's reader checks."""

    dtype: str | None


class LocalRows(Sequence[dict[str, Any]]):
    """Rows in memory, each a dict holding every field of the files (``None`` where a row
    lacks one, as ``datasets`` fills them). ``features``: the fields, as ``datasets`` gives
    them for a check before reading."""

    def __init__(self, rows: list[dict[str, Any]], features: dict[str, Column]):
        self._rows = rows
        self.features = features

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        row = self._rows[index]
        return {key: row.get(key) for key in self.features}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def iter(self, batch_size: int) -> Iterator[dict[str, list[Any]]]:
        """Batches of ``batch_size`` rows as columns (the shape ``datasets.Dataset.iter``
        gives: ``scripts/pretokenize.py`` reads either)."""
        for start in range(0, len(self), batch_size):
            rows = [self[i] for i in range(start, min(start + batch_size, len(self)))]
            yield {key: [row[key] for row in rows] for key in self.features}

    def shard(self, rank: int, world: int) -> LocalRows:
        """Rank ``rank``'s contiguous block of ``world`` (``split_dataset_by_node``'s split)."""
        start, stop = contiguous_block(len(self._rows), rank, world)
        return LocalRows(self._rows[start:stop], self.features)


def fits_in_memory(files: Sequence[Path]) -> bool:
    """Whether ``read_rows`` takes these files (else ``datasets`` does): none is zstd, and
    they hold ``IN_MEMORY_BYTES`` at most on disk."""
    no_zstd = all(f.suffix != ".zst" for f in files)
    return no_zstd and sum(f.stat().st_size for f in files) <= IN_MEMORY_BYTES


def read_rows(files: Sequence[Path], fmt: str, where: str) -> LocalRows:
    """The rows of ``files`` of format ``fmt`` (``json`` or ``text``, as ``data_sources`` names
    them), refused in one line naming ``where`` (the flag) and the first bad line."""
    rows: list[dict[str, Any]] = []
    for path in files:
        text = _read_text(path, where)
        rows += _paragraphs(text) if fmt == "text" else _json_rows(text, path, where)
    return LocalRows(rows, _features(rows))


def _read_text(path: Path, where: str) -> str:
    opener = _OPEN.get(path.suffix, open)
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise ConfigError(f"{where}: cannot read {path} ({e})") from None
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: {path} is not UTF-8 text ({e})") from None


def _paragraphs(text: str) -> list[dict[str, Any]]:
    # Universal newlines, as a file opened in text mode reads. (JSON needs no translation:
    # a line's "\r" before "\n" is whitespace to the parser, and fewer copies of a large file.)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return [{"text": paragraph} for paragraph in text.split("\n\n") if paragraph]


def _json_rows(text: str, path: Path, where: str) -> list[dict[str, Any]]:
    if text.startswith("["):  # one JSON list: of objects, or of strings (text rows)
        try:
            items = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{where}: {path} is not valid JSON ({e})") from None
        rows = [{"text": item} if isinstance(item, str) else item for item in items]
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if bad is not None:
            raise ConfigError(
                f"{where}: {path}: item {bad} of its list is {type(items[bad]).__name__}, "
                "not an object or a string"
            )
        return rows
    rows = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as bad:
            raise ConfigError(
                f"{where}: {path}, line {n} is not valid JSON ({bad}): {line.strip()[:60]!r}"
            ) from None
        if not isinstance(row, dict):
            raise ConfigError(
                f"{where}: {path}, line {n} is a JSON {type(row).__name__}, not an object: "
                f"{line.strip()[:60]!r}"
            )
        rows.append(row)
    return rows


_DTYPES = {str: "string", bool: "bool", int: "int64", float: "float64"}


def _features(rows: list[dict[str, Any]]) -> dict[str, Column]:
    """Every field of the rows, in the order first seen, with its values' one JSON type."""
    types: dict[str, set[type]] = {}
    for row in rows:
        for key, value in row.items():
            seen = types.setdefault(key, set())
            if value is not None:
                seen.add(type(value))
    features = {}
    for key, seen in types.items():
        if seen == {int, float}:  # as Arrow reads a column of both
            seen = {float}
        only = next(iter(seen)) if len(seen) == 1 else None
        features[key] = Column(_DTYPES.get(only))
    return features

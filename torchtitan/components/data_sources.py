"""Where datasets come from: the registry of named datasets (``--training.dataset``), local
json/jsonl/parquet/txt files (``files``), hub datasets streamed, pre-tokenized folders
(``tokens``), and the fields each ``--training.data_format`` reads from a row, checked when a
dataset is opened. Bad files are named with their first bad line.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.components.local_rows import LocalRows, fits_in_memory, read_rows
from torchtitan.components.token_shards import TokenFolder, open_folder
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger
from torchtitan.tools.paths import resolve_path

if TYPE_CHECKING:
    import datasets

    HFDataset = datasets.Dataset | datasets.IterableDataset
else:
    HFDataset = Any  # named without importing ``datasets``


def _datasets() -> Any:
    """The ``datasets`` library, imported when documents are first read: a run of
    pre-tokenized data never imports it (with pandas and pyarrow, half a second a rank)."""
    import datasets

    # Progress bars from every rank garble the console; the trainer logs what it opens.
    datasets.disable_progress_bars()
    return datasets


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives and how to open it."""

    path: str | None
    """Hub id or local path; ``--training.dataset_path`` overrides it."""
    loader: Callable[[str], Any]
    """Opens ``path``: a ``datasets`` dataset of rows, or a pre-tokenized ``TokenFolder``."""
    text_key: str = "text"
    data_format: str = "text"
    """What its rows hold (``--training.data_format``): ``text``, ``chat``, ``prompt_completion``."""


def _load_c4(split: str) -> Callable[[str], HFDataset]:
    def load(path: str) -> HFDataset:
        # Streaming: C4 is ~300 GB; nothing is downloaded ahead of use.
        return _datasets().load_dataset(path, name="en", split=split, streaming=True)

    return load


_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


def load_files(path: str) -> LocalRows | datasets.Dataset:
    """Open json/jsonl/parquet/txt files: one file, a glob, or a folder of one format; small
    ones are read into memory (``local_rows``), the others through ``datasets``."""
    resolved = resolve_path(path)
    if resolved.is_dir():
        files = sorted(p for p in resolved.rglob("*") if _file_format(p) is not None)
    else:
        files = sorted(Path(p) for p in glob.glob(str(resolved)))
    if not files:
        raise FileNotFoundError(
            f"--training.dataset_path {path}: no .json/.jsonl/.parquet/.txt files found there"
        )
    formats = {_file_format(f) for f in files}
    if None in formats:
        unknown = [f for f in files if _file_format(f) is None]
        raise ConfigError(
            f"--training.dataset_path {path}: {unknown[0]}"
            f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''} has an unknown "
            f"type; use files ending in one of {', '.join(sorted(_FORMATS))}"
        )
    if len(formats) != 1:
        raise ConfigError(
            f"--training.dataset_path {path} mixes file types ({', '.join(sorted(formats))}); "
            "point it at files of one type"
        )
    fmt = formats.pop()
    where = f"--training.dataset_path {path}"
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"{where}: {_names(files)} empty; point it at files with documents")
    if fmt != "parquet" and fits_in_memory(files):
        data = read_rows(files, fmt, where)
    else:
        data = _load_with_datasets(files, fmt, where)
    if len(data) == 0:
        raise ConfigError(f"{where}: {_names(files)} no documents")
    return data


def _load_with_datasets(files: list[Path], fmt: str, where: str) -> datasets.Dataset:
    """``datasets.load_dataset`` of the files (memory-mapped Arrow), its errors in one line."""
    # A .txt file becomes one document per paragraph (blank-line separated).
    extra = {"sample_by": "paragraph"} if fmt == "text" else {}
    datasets = _datasets()  # imported first: its import sets its logger's level
    quiet = logging.getLogger("datasets")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # its own error line would come before ours
    try:
        return datasets.load_dataset(
            fmt, data_files=[str(f) for f in files], split="train", **extra
        )
    except Exception as e:  # pyarrow / pandas tracebacks: one line naming the file instead
        raise ConfigError(f"{where}: {_unreadable(files, fmt, e)}") from None
    finally:
        quiet.setLevel(level)


def load_tokens(path: str) -> Any:
    """Open a folder ``scripts/pretokenize.py`` wrote (a ``TokenFolder``)."""
    return open_folder(resolve_path(path), given=f"--training.dataset_path {path}")


def _names(files: list[Path]) -> str:
    return f"{files[0]} is" if len(files) == 1 else f"all {len(files)} files ({files[0]}, ...) are"


def _unreadable(files: list[Path], fmt: str, error: Exception) -> str:
    """Why the files cannot be read: the first line that is not JSON (for JSON lines), else
    the reader's own first line."""
    budget = 1_000_000  # lines: a first bad line is found fast; a huge corpus is not re-read
    for f in files if fmt == "json" else []:
        if ".jsonl" not in f.suffixes:
            continue  # a JSON array spans lines: its reader's message says more
        with open(f, encoding="utf-8", errors="replace") as lines:
            for n, line in enumerate(lines, start=1):
                budget -= 1
                if budget < 0:
                    break
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except ValueError as bad:
                    return f"{f}, line {n} is not valid JSON ({bad}): {line.strip()[:60]!r}"
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    cause = error.__cause__ or error.__context__
    if cause is not None and str(cause).strip():
        reason = str(cause).strip().splitlines()[0]
    return f"cannot read the {fmt} files ({reason})"


def _file_format(path: Path) -> str | None:
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in (".gz", ".zst", ".bz2", ".xz"):
        suffixes = suffixes[:-1]
    return _FORMATS.get(suffixes[-1]) if suffixes else None


DATASETS: dict[str, DatasetSpec] = {
    "python_docs": DatasetSpec(path="tests/assets/corpus/train.jsonl", loader=load_files),
    "python_docs_validation": DatasetSpec(
        path="tests/assets/corpus/validation.jsonl", loader=load_files
    ),
    "c4": DatasetSpec(path="allenai/c4", loader=_load_c4("train")),
    "c4_validation": DatasetSpec(path="allenai/c4", loader=_load_c4("validation")),
    "chat_demo": DatasetSpec(
        path="tests/assets/chat/train.jsonl", loader=load_files, data_format="chat"
    ),
    "chat_demo_validation": DatasetSpec(
        path="tests/assets/chat/validation.jsonl", loader=load_files, data_format="chat"
    ),
    "files": DatasetSpec(path=None, loader=load_files),
    "tokens": DatasetSpec(path=None, loader=load_tokens),
}

FIELDS = {"text": ("text",), "chat": ("messages",), "prompt_completion": ("prompt", "completion")}
"""The fields each ``--training.data_format`` reads from a row."""


def check_format(
    name: str, data_format: str, *, flag: str = "--training", entry: str | None = None
) -> DatasetSpec:
    """The registered dataset ``name``, refused in one line if it is not registered or holds
    rows of another format than ``data_format`` (``files`` holds any). ``entry``: the
    ``--training.dataset_mix`` entry that names it, for the messages."""
    named = f"--training.dataset_mix {entry}: {name}" if entry else f"{flag}.dataset {name}"
    if name not in DATASETS:
        raise ConfigError(f"{named} is not registered; choose one of {', '.join(DATASETS)}")
    spec = DATASETS[name]
    if name == "tokens" and data_format != "text":
        raise ConfigError(
            f"{named}: pre-tokenized windows have no samples or roles, and "
            f"--training.data_format {data_format} reads them from rows; point it at the "
            "samples' json (files) or pass --training.data_format text"
        )
    if name != "files" and spec.data_format != data_format:
        if entry:
            fix = "every dataset of a mix reads that format; drop it from the mix"
        elif flag == "--training":
            fix = f"pass --training.data_format {spec.data_format}"
        else:
            fix = f"pass a {flag}.dataset of {data_format} rows" + next(
                (
                    f" (e.g. {other})"
                    for other, s in DATASETS.items()
                    if s.data_format == data_format and other.endswith("_validation")
                ),
                "",
            )
        raise ConfigError(
            f"{named} holds {spec.data_format} rows, and this run reads "
            f"--training.data_format {data_format}; {fix}"
        )
    return spec


def open_dataset(
    name: str,
    path: str | None,
    *,
    data_format: str = "text",
    flag: str = "--training",
    entry: str | None = None,
) -> tuple[HFDataset, str]:
    """Open a registered dataset (``path`` overrides its location); return it and its text
    key. Its rows must hold the fields of ``data_format`` (``FIELDS``). ``flag``: the config
    section that names the dataset (``--validation`` for the validation data); ``entry``:
    the ``--training.dataset_mix`` entry that names it (messages name the entry)."""
    spec = check_format(name, data_format, flag=flag, entry=entry)
    path = path or spec.path
    if path is None:
        if entry:
            raise ConfigError(f"--training.dataset_mix {entry}: give its path, {name}=PATH:WEIGHT")
        raise ConfigError(f"{flag}.dataset {name} needs {flag}.dataset_path")
    # How messages name where the rows come from.
    source = f"--training.dataset_mix {entry}" if entry else f"{flag}.dataset_path {path}"
    logger.info(f"Opening dataset {name} from {path}")
    try:
        data = spec.loader(path)
    except ConnectionError as e:  # a hub dataset without network (or a hub id mistyped)
        raise ConfigError(
            f"{source if entry else f'{flag}.dataset {name}'}: cannot reach {path} "
            f"({str(e).splitlines()[0]}); without network, point "
            f"{'its path' if entry else f'{flag}.dataset_path'} at a local copy of it"
        ) from None
    except (ConfigError, FileNotFoundError) as e:  # the files' own line, named as given
        if entry is None and flag == "--training":
            raise
        raise ConfigError(str(e).replace(f"--training.dataset_path {path}", source)) from None
    if isinstance(data, TokenFolder):  # messages name it as this run does
        return dataclasses.replace(data, label=source), spec.text_key
    features = getattr(data, "features", None)
    if features is not None:  # known before reading (files); a stream is checked per row
        wanted = (spec.text_key,) if data_format == "text" else FIELDS[data_format]
        missing = [key for key in wanted if key not in features]
        if missing:
            hint = next(
                (
                    f"; rows with {' and '.join(map(repr, keys))} are read with "
                    f"--training.data_format {fmt}"
                    for fmt, keys in FIELDS.items()
                    if fmt != data_format and all(k in features for k in keys)
                ),
                "",
            )
            raise ConfigError(
                f"{source}: its rows have the fields {sorted(features)}, "
                f"no {missing[0]!r}; --training.data_format {data_format} reads rows with "
                f"{' and '.join(map(repr, wanted))}{hint}"
            )
        key = spec.text_key
        # No dtype (nested or mixed values): each row's reader checks its own.
        dtype = getattr(features[key], "dtype", None) if data_format == "text" else None
        if dtype not in (None, "string", "large_string"):
            raise ConfigError(f"{source}: the {key!r} field holds {features[key].dtype}, not text")
    return data, spec.text_key


def is_stream(data: HFDataset) -> bool:
    """A streamed ``datasets`` dataset (read in order, resumed by its own state)."""
    if isinstance(data, LocalRows):
        return False  # and ``datasets`` may not be imported at all
    import datasets

    return isinstance(data, datasets.IterableDataset)


def shard(data: HFDataset, rank: int, world: int) -> HFDataset:
    """Data-parallel rank ``rank``'s share: a contiguous block of the documents, or (a
    stream) of its shards."""
    if isinstance(data, LocalRows):
        return data.shard(rank, world)
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(data, rank=rank, world_size=world)

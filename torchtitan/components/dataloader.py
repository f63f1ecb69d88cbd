"""Datasets and the data-parallel-aware, resumable dataloader.

Documents are read through Hugging Face ``datasets`` (hub datasets streamed, local files
memory-mapped), each data-parallel rank keeps a disjoint shard (``split_dataset_by_node``),
every document is tokenized with BOS/EOS and the token stream is cut into windows of
``seq_len + 1`` tokens (inputs are the first ``seq_len``, labels the last ``seq_len``).
``state_dict()`` captures the exact read position, including tokens of a partly used document.
"""

import dataclasses
import glob
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import datasets
import torch
from datasets.distributed import split_dataset_by_node
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger
from torchtitan.tools.paths import resolve_path

HFDataset = datasets.Dataset | datasets.IterableDataset

# Progress bars from every rank garble the console; the trainer logs what it opens.
datasets.disable_progress_bars()
# torchdata 0.11 calls a deprecated torch API on every loader construction; nothing to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def document_ids(tokens: torch.Tensor, start_token: int) -> torch.Tensor:
    """``[bs, seq]`` int32: each token's document within its window of packed documents,
    counting the documents that start (with ``start_token``, the begin-of-text token every
    document is tokenized with) at or before it. The first tokens of a window, whose document
    began in an earlier window, are document 0. What block-causal attention needs."""
    return torch.cumsum(tokens == start_token, dim=1, dtype=torch.int32)


class Tokenizer(Protocol):
    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives and how to open it."""

    path: str | None
    """Hub id or local path; ``--training.dataset_path`` overrides it."""
    loader: Callable[[str], HFDataset]
    text_key: str = "text"


def _load_c4(split: str) -> Callable[[str], HFDataset]:
    def load(path: str) -> HFDataset:
        # Streaming: C4 is ~300 GB; nothing is downloaded ahead of use.
        return datasets.load_dataset(path, name="en", split=split, streaming=True)

    return load


_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


def load_files(path: str) -> datasets.Dataset:
    """Open json/jsonl/parquet/txt files: one file, a glob, or a folder of one format."""
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
    if len(formats) != 1 or None in formats:
        raise ValueError(
            f"--training.dataset_path {path} mixes or has unknown file types "
            f"({sorted(str(f) for f in formats)}); use one of {sorted(_FORMATS)}"
        )
    fmt = formats.pop()
    # A .txt file becomes one document per paragraph (blank-line separated).
    extra = {"sample_by": "paragraph"} if fmt == "text" else {}
    where = f"--training.dataset_path {path}"
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"{where}: {_names(files)} empty; point it at files with documents")
    quiet = logging.getLogger("datasets")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # its own error line would come before ours
    try:
        data = datasets.load_dataset(
            fmt, data_files=[str(f) for f in files], split="train", **extra
        )
    except Exception as e:  # pyarrow / pandas tracebacks: one line naming the file instead
        raise ConfigError(f"{where}: {_unreadable(files, fmt, e)}") from None
    finally:
        quiet.setLevel(level)
    if len(data) == 0:
        raise ConfigError(f"{where}: {_names(files)} no documents")
    return data


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
    "files": DatasetSpec(path=None, loader=load_files),
}


def open_dataset(name: str, path: str | None) -> tuple[HFDataset, str]:
    """Open a registered dataset (``path`` overrides its location); return it and its text key."""
    if name not in DATASETS:
        raise ConfigError(
            f"--training.dataset {name} is not registered; choose one of {', '.join(DATASETS)}"
        )
    spec = DATASETS[name]
    path = path or spec.path
    if path is None:
        raise ConfigError(f"--training.dataset {name} needs --training.dataset_path")
    logger.info(f"Opening dataset {name} from {path}")
    data = spec.loader(path)
    features = getattr(data, "features", None)
    if features is not None:  # known before reading (files); a stream is checked per row
        key = spec.text_key
        if key not in features:
            raise ConfigError(
                f"--training.dataset_path {path}: its rows have the fields "
                f"{sorted(features)}, no {key!r}; every row needs a {key!r} field holding text"
            )
        if getattr(features[key], "dtype", "string") not in ("string", "large_string"):
            raise ConfigError(
                f"--training.dataset_path {path}: the {key!r} field holds "
                f"{features[key].dtype}, not text"
            )
    return data, spec.text_key


class TextDataset(IterableDataset, Stateful):
    """Packs tokenized documents of one data-parallel shard into ``seq_len + 1`` windows.

    Yields ``({"input": LongTensor[seq_len]}, labels: LongTensor[seq_len])``. With
    ``infinite=True`` it starts a new epoch over its shard when it runs out; otherwise each
    ``iter()`` is one fresh pass (what validation wants). Dataloader workers split the shard.
    """

    def __init__(
        self,
        data: HFDataset,
        *,
        name: str,
        tokenizer: Tokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        text_key: str = "text",
    ):
        if isinstance(data, datasets.Dataset) and len(data) < dp_world_size:
            raise ConfigError(
                f"dataset {name} has {len(data)} documents, fewer than the {dp_world_size} "
                "data-parallel ranks; use a larger dataset or fewer ranks"
            )
        self.name = name
        self._where = f"data-parallel rank {dp_rank} of {dp_world_size}"
        self._data = split_dataset_by_node(data, rank=dp_rank, world_size=dp_world_size)
        self._streaming = isinstance(self._data, datasets.IterableDataset)
        self._tokenizer = tokenizer
        self._seq_len = seq_len
        self._infinite = infinite
        self._text_key = text_key
        self._epoch = 0
        self._sample_idx = 0  # next document index of this shard (map-style datasets)
        self._token_buffer: list[int] = []
        self._read_text = False  # any non-empty document seen by this reader
        # A stream reports its loaded position only once it is iterated again; until then
        # state_dict() must return the loaded position itself.
        self._loaded_stream_state: dict[str, Any] | None = None
        if self._streaming:
            self._stream_start = self._data.state_dict()

    def _documents(self) -> Iterator[dict[str, Any]]:
        if self._streaming:
            # Hugging Face splits a stream's shards between dataloader workers itself.
            for document in self._data:
                self._loaded_stream_state = None
                yield document
            return
        info = get_worker_info()
        stride, offset = (info.num_workers, info.id) if info is not None else (1, 0)
        for i in range(self._sample_idx, len(self._data)):
            if i % stride == offset:
                self._sample_idx = i + 1
                yield self._data[i]
        self._sample_idx = len(self._data)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        window = self._seq_len + 1
        empty_passes = 0
        while True:
            documents = characters = 0
            # A resumed pass may start near the end, where only empty documents are left.
            started_at_first = self._streaming or self._sample_idx == 0
            for document in self._documents():
                documents += 1
                text = document.get(self._text_key)
                if not isinstance(text, str):
                    key = self._text_key
                    what = (
                        f"no {key!r} field"
                        if text is None
                        else f"a {type(text).__name__} as {key!r}, not text"
                    )
                    raise ConfigError(
                        f"dataset {self.name}: a row of {self._where} has {what} "
                        f"({str(document)[:80]}); every row needs a {key!r} field holding text"
                    )
                characters += len(text)
                self._token_buffer.extend(self._tokenizer.encode(text, add_bos=True, add_eos=True))
                while len(self._token_buffer) >= window:
                    tokens = torch.tensor(self._token_buffer[:window], dtype=torch.long)
                    self._token_buffer = self._token_buffer[window:]
                    yield {"input": tokens[:-1]}, tokens[1:]
            # A resumed pass may legitimately start at the end; two empty passes in a row
            # mean this shard has no documents at all.
            empty_passes = empty_passes + 1 if documents == 0 else 0
            if empty_passes >= 2:
                raise ConfigError(
                    f"dataset {self.name} has no documents for {self._where}"
                    f"{self._worker_note()}: it has fewer documents or shards than readers; "
                    "use fewer ranks or --training.num_workers 0"
                )
            self._read_text = self._read_text or characters > 0
            if documents and not characters and not self._read_text and started_at_first:
                raise ConfigError(
                    f"dataset {self.name}: all {documents} documents of {self._where} are "
                    "empty; training on them would learn only the begin/end tokens"
                )
            if not self._infinite:
                self._rewind(self._epoch)
                return
            self._rewind(self._epoch + 1)
            if self._epoch & (self._epoch - 1) == 0:  # epochs 1, 2, 4, 8, ...: not every pass
                logger.warning(
                    f"Dataset {self.name} is being re-looped: epoch {self._epoch} of "
                    f"{self._where} (a dataset shorter than the run repeats)"
                )

    def _rewind(self, epoch: int) -> None:
        """Go back to the first document, as epoch ``epoch``."""
        self._epoch = epoch
        self._sample_idx = 0
        if not self._infinite:
            self._token_buffer = []
        if self._streaming:
            self._data.set_epoch(epoch)
            self._data.load_state_dict(self._stream_start)
            self._loaded_stream_state = None

    @staticmethod
    def _worker_note() -> str:
        info = get_worker_info()
        return f" (dataloader worker {info.id} of {info.num_workers})" if info is not None else ""

    def state_dict(self) -> dict[str, Any]:
        state = {
            "epoch": self._epoch,
            "sample_idx": self._sample_idx,
            "token_buffer": list(self._token_buffer),
        }
        if self._streaming:
            state["stream"] = self._loaded_stream_state or self._data.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = state["epoch"]
        self._sample_idx = state["sample_idx"]
        self._token_buffer = list(state["token_buffer"])
        if self._streaming:
            self._data.set_epoch(self._epoch)
            self._data.load_state_dict(state["stream"])
            self._loaded_stream_state = state["stream"]


class _RowsOf:
    """Collate only rows ``[start, stop)`` of a batch: this rank's part of a global batch."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop

    def __call__(self, samples: list) -> Any:
        return default_collate(samples[self.start : self.stop])


class ParallelAwareDataloader(StatefulDataLoader, Stateful):
    """A ``StatefulDataLoader`` whose state is keyed by data-parallel rank.

    A checkpoint holds one entry per DP rank. Under ``by_document`` sharding each entry is a
    position in that rank's own shard, so loading under another DP degree is refused (the
    shards would not line up; ``--checkpoint.exclude_from_loading dataloader`` restarts the
    data). Under ``by_row``, or with a single rank, every rank reads the whole stream, the
    entries are identical (``replicated_state``) and any one resumes any DP degree.
    """

    def __init__(
        self,
        dataset: IterableDataset,
        *,
        dp_rank: int,
        dp_world_size: int,
        batch_size: int,
        num_workers: int = 0,
        collate_fn: Callable | None = None,
        sharding: str = "by_document",
        drop_last: bool = False,
    ):
        super().__init__(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate_fn,
            drop_last=drop_last,
        )
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.sharding = sharding
        self._rank_key = f"dp_rank_{dp_rank}"

    @property
    def replicated_state(self) -> bool:
        """Whether this state stands for every DP rank: ``by_row``, or a single rank."""
        return _reads_whole_stream(self.sharding, self.dp_world_size)

    def state_dict(self) -> dict[str, Any]:
        return {
            "dp_world_size": self.dp_world_size,
            "sharding": self.sharding,
            "num_workers": self.num_workers,
            self._rank_key: super().state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        sharding = state_dict.get("sharding", "by_document")
        degree = state_dict.get("dp_world_size")
        entries = [k for k in state_dict if k.startswith("dp_rank_")]
        workers = state_dict.get("num_workers", self.num_workers)
        if workers != self.num_workers:  # torchdata keeps one state per worker
            raise ConfigError(
                f"dataloader state was saved with --training.num_workers {workers}, this run "
                f"has {self.num_workers}; resume with {workers} or pass "
                "--checkpoint.exclude_from_loading dataloader"
            )
        if (sharding, degree) == (self.sharding, self.dp_world_size):
            if self._rank_key not in state_dict:
                raise ValueError(f"dataloader state has no entry for {self._rank_key}")
            super().load_state_dict(state_dict[self._rank_key])
        elif self.replicated_state and _reads_whole_stream(sharding, degree) and entries:
            # Both read the whole stream: the saved position is every rank's position.
            super().load_state_dict(state_dict[entries[0]])
        elif sharding != self.sharding:
            raise ConfigError(
                f"dataloader state was saved with --training.data_sharding {sharding}, this "
                f"run has {self.sharding}; resume with {sharding} or pass "
                "--checkpoint.exclude_from_loading dataloader"
            )
        else:
            raise ConfigError(
                f"dataloader state was saved with data-parallel degree {degree}, this run has "
                f"{self.dp_world_size}; resume with the same degree or pass "
                "--checkpoint.exclude_from_loading dataloader (runs that change the degree keep "
                "their place with --training.data_sharding by_row)"
            )


def _reads_whole_stream(sharding: str, dp_world_size: int) -> bool:
    """Every rank reads the whole stream in the same global batches (so states agree)."""
    return sharding == "by_row" or dp_world_size == 1


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    infinite: bool = True,
    num_workers: int = 0,
    sharding: str = "by_document",
    drop_last: bool = False,
) -> ParallelAwareDataloader:
    """Open ``dataset`` and wrap this DP rank's share of it in a resumable dataloader.

    ``sharding="by_document"`` gives each DP rank its own documents; ``"by_row"`` has every
    rank read the whole stream in global batches of ``local_batch_size x dp_world_size`` rows
    and keep rows ``[dp_rank x local_batch_size, ...)``, so the global batch of a step does not
    depend on the DP degree, and its state resumes under any DP degree. ``drop_last``: a
    finite pass ends at its last full batch (under ``by_row`` a partial global batch would
    leave some ranks no rows at all).
    """
    data, text_key = open_dataset(dataset, dataset_path)
    by_row = sharding == "by_row"
    text = TextDataset(
        data,
        name=dataset,
        tokenizer=tokenizer,
        seq_len=seq_len,
        dp_rank=0 if by_row else dp_rank,
        dp_world_size=1 if by_row else dp_world_size,
        infinite=infinite,
        text_key=text_key,
    )
    rows = local_batch_size * dp_world_size if by_row else local_batch_size
    start = dp_rank * local_batch_size if by_row else 0
    return ParallelAwareDataloader(
        text,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=rows,
        num_workers=num_workers,
        collate_fn=_RowsOf(start, start + local_batch_size),
        sharding=sharding,
        drop_last=drop_last,
    )

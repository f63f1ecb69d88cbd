"""Datasets and the data-parallel-aware, resumable dataloader.

Documents are read through Hugging Face ``datasets`` (hub datasets streamed, large local files
memory-mapped) or, small local files, from memory (``local_rows``); each data-parallel rank
keeps a disjoint shard (``split_dataset_by_node``'s contiguous blocks); every document is
tokenized with BOS/EOS and the token stream is cut into windows of ``seq_len + 1`` tokens
(inputs are the first ``seq_len``, labels the last ``seq_len``). ``state_dict()`` captures the
exact read position, including tokens of a partly used document. Pre-tokenized folders
(``--training.dataset tokens``) are read by ``token_windows`` instead. ``datasets`` is imported
only for what it reads (half a second of every rank's start).
"""

import functools
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.data_mix import MixedDataset
from torchtitan.components.data_sources import HFDataset, is_stream, open_dataset, shard
from torchtitan.components.data_state import check_text_state
from torchtitan.components.token_shards import TokenFolder
from torchtitan.components.token_windows import TokenWindows, contiguous_block, log_reloop
from torchtitan.config.entries import MixEntry
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger

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
        flag: str = "--training",
        where: str | None = None,
        shuffle_seed: int | None = None,
    ):
        """``flag``: the config section whose flags the messages name (``--validation`` for
        the validation data); ``where``: who reads, in messages (default: this DP rank).
        ``shuffle_seed``: read the documents in a random order drawn from it, a new one each
        epoch (``None``: in the data's order)."""
        self._streaming = is_stream(data)
        if not self._streaming and len(data) < dp_world_size:
            raise ConfigError(
                f"dataset {name} has {len(data)} documents, fewer than the {dp_world_size} "
                "data-parallel ranks; use a larger dataset or fewer ranks"
            )
        self.name = name
        self._where = where or f"data-parallel rank {dp_rank} of {dp_world_size}"
        self._flag = flag
        self._format = "text"
        self._data = shard(data, dp_rank, dp_world_size)
        if shuffle_seed is not None and self._streaming:
            raise ConfigError(
                f"--training.shuffle_seed: dataset {name} is streamed, and a stream cannot be "
                "shuffled and resumed exactly; drop the flag, or read a local copy "
                "(--training.dataset_path)"
            )
        self._shuffle_seed = shuffle_seed
        # Shuffled: this rank's block of a permutation of every document, drawn per epoch.
        self._all = data
        self._block = (
            contiguous_block(len(data), dp_rank, dp_world_size) if not self._streaming else None
        )
        self._order: tuple[int, Any] | None = None  # (epoch, its document indices)
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
        self._node = (dp_rank, dp_world_size)

    def _documents(self) -> Iterator[dict[str, Any]]:
        if self._streaming:
            # Hugging Face splits a stream's shards between dataloader workers itself.
            for document in self._data:
                self._loaded_stream_state = None
                yield document
            return
        info = get_worker_info()
        stride, offset = (info.num_workers, info.id) if info is not None else (1, 0)
        source, indices = self._documents_of_epoch()
        for i in range(self._sample_idx, len(indices)):
            if i % stride == offset:
                self._sample_idx = i + 1
                yield source[int(indices[i])]
        self._sample_idx = len(indices)

    def _documents_of_epoch(self) -> tuple[HFDataset, Any]:
        """The dataset to index and this rank's indices into it, in reading order: its shard
        in order, or (shuffled) its block of this epoch's permutation of every document, so
        each rank reads a random part of the whole data, another each epoch."""
        if self._shuffle_seed is None:
            return self._data, range(len(self._data))
        if self._order is None or self._order[0] != self._epoch:
            # Seeded by the dataset's name too: datasets of a mix draw different orders. The
            # block is copied so that the whole permutation (8 bytes a document) is freed.
            entropy = [self._shuffle_seed, self._epoch, zlib.crc32(self.name.encode())]
            permutation = numpy.random.default_rng(entropy).permutation(len(self._all))
            self._order = (self._epoch, permutation[slice(*self._block)].copy())
        return self._all, self._order[1]

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        empty_passes = 0
        while True:
            yield from self._carried_windows()
            documents = 0
            self._characters = 0
            # A resumed pass may start near the end, where only empty documents are left.
            started_at_first = self._streaming or self._sample_idx == 0
            for document in self._documents():
                documents += 1
                yield from self._windows(document)
            # A resumed pass may legitimately start at the end; two empty passes in a row
            # mean this shard has no documents at all.
            empty_passes = empty_passes + 1 if documents == 0 else 0
            if empty_passes >= 2:
                raise ConfigError(
                    f"dataset {self.name} has no documents for {self._where}"
                    f"{self._worker_note()}: it has fewer documents or shards than readers; "
                    "use fewer ranks or --training.num_workers 0"
                )
            if not self._infinite:
                yield from self._last_windows()
            self._check_pass(documents, started_at_first=started_at_first)
            if not self._infinite:
                self._rewind(self._epoch)
                return
            self._rewind(self._epoch + 1)
            log_reloop(self.name, self._epoch, self._where)

    def _windows(self, document: dict[str, Any]) -> Iterator[tuple[dict, torch.Tensor]]:
        """The windows that complete once ``document`` is added to the token stream."""
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
        self._characters += len(text)
        self._token_buffer.extend(self._tokenizer.encode(text, add_bos=True, add_eos=True))
        window = self._seq_len + 1
        while len(self._token_buffer) >= window:
            tokens = torch.tensor(self._token_buffer[:window], dtype=torch.long)
            self._token_buffer = self._token_buffer[window:]
            yield {"input": tokens[:-1]}, tokens[1:]

    def _check_pass(self, documents: int, *, started_at_first: bool) -> None:
        """After a pass over the shard: refuse a shard that has nothing to train on."""
        self._read_text = self._read_text or self._characters > 0
        if documents and not self._characters and not self._read_text and started_at_first:
            raise ConfigError(
                f"dataset {self.name}: all {documents} documents of {self._where} are "
                "empty; training on them would learn only the begin/end tokens"
            )

    def _carried_windows(self) -> Iterator[tuple[dict, torch.Tensor]]:
        """Windows a resumed state holds complete, yielded before the next document is read
        (text: none; its buffer is cut as documents come)."""
        return iter(())

    def _last_windows(self) -> Iterator[tuple[dict, torch.Tensor]]:
        """What a finite pass yields after its last document (text: nothing; the tokens
        short of a window are left out)."""
        return iter(())

    def _rewind(self, epoch: int) -> None:
        """Go back to the first document, as epoch ``epoch``."""
        self._epoch = epoch
        self._sample_idx = 0
        if not self._infinite:
            self._token_buffer = []
        if self._streaming:
            # A fresh split, not the first position loaded back: a dataloader worker's stream
            # picks its share of the shards when it starts (a loaded state would carry the
            # unsplit stream's, and the worker would read the other workers' shards).
            self._data = shard(self._all, *self._node)
            self._data.set_epoch(epoch)
            self._loaded_stream_state = None

    @staticmethod
    def _worker_note() -> str:
        info = get_worker_info()
        return f" (dataloader worker {info.id} of {info.num_workers})" if info is not None else ""

    def state_dict(self) -> dict[str, Any]:
        state = {
            "dataset": self.name,
            "format": self._format,
            "shuffle_seed": self._shuffle_seed,
            "epoch": self._epoch,
            "sample_idx": self._sample_idx,
            "token_buffer": list(self._token_buffer),
        }
        if not self._streaming:
            state["documents"] = len(self._all)  # what a resume checks (data_state)
        else:
            state["stream"] = self._loaded_stream_state or self._data.state_dict()
        return state

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse (one line) a saved state this dataset cannot continue; warn where it
        continues on what may be other data (``data_state.check_text_state``)."""
        check_text_state(
            state,
            name=self.name,
            data_format=self._format,
            shuffle_seed=self._shuffle_seed,
            documents=None if self._streaming else len(self._all),
            sharded=self._node[1] > 1,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
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
        for source in getattr(dataset, "sources", [dataset]):  # a mix's, or the one
            if hasattr(source, "check_readers"):
                source.check_readers(num_workers)
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
            "rows": self.batch_size,  # a batch's, before this rank's part is taken
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
        # Checked here, in the training process: dataloader workers load their own share
        # later, where a refusal would surface as a worker's traceback at the first batch.
        for entry in entries:
            for dataset_state in _dataset_states(state_dict[entry]):
                self.dataset.check_state(dataset_state)
        if (sharding, degree) == (self.sharding, self.dp_world_size):
            if self._rank_key not in state_dict:
                raise ValueError(f"dataloader state has no entry for {self._rank_key}")
            self._note_regrouping(state_dict.get("rows", self.batch_size))
            super().load_state_dict(state_dict[self._rank_key])
        elif self.replicated_state and _reads_whole_stream(sharding, degree) and entries:
            # Both read the whole stream: the saved position is every rank's position.
            if self.dp_rank == 0:  # once (COMM_MODE=local_tensor runs every rank here)
                logger.info(
                    f"Dataloader state of {degree} data-parallel ranks continues on "
                    f"{self.dp_world_size}: each reads the whole stream, so one saved position "
                    "serves every rank"
                )
            self._note_regrouping(state_dict.get("rows", self.batch_size))
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

    def _note_regrouping(self, rows: int) -> None:
        """Workers make whole batches from their own share of the stream, so which windows
        make a step depends on the rows per batch: say so where that changed."""
        if self.num_workers and rows != self.batch_size and self.dp_rank == 0:
            logger.info(
                f"Dataloader state saved reading {rows} rows per batch continues at "
                f"{self.batch_size}: no window is skipped or read twice, but with "
                f"--training.num_workers {self.num_workers} each worker's windows are grouped "
                "into steps otherwise than in an uninterrupted run of this layout"
            )


def _dataset_states(state: Any) -> Iterator[dict[str, Any]]:
    """The dataset states inside a ``StatefulDataLoader`` state: its own, or each worker's."""
    if isinstance(state, dict):
        if ("sample_idx" in state and "epoch" in state) or "mix" in state:
            yield state
            return
        for value in state.values():
            yield from _dataset_states(value)


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
    data_format: str = "text",
    make_dataset: Callable[..., TextDataset] | None = None,
    flag: str = "--training",
    mix: Sequence[MixEntry] = (),
    shuffle_seed: int | None = None,
) -> ParallelAwareDataloader:
    """Open ``dataset`` and wrap this DP rank's share of it in a resumable dataloader.

    ``sharding="by_document"`` gives each DP rank its own documents; ``"by_row"`` has every
    rank read the whole stream in global batches of ``local_batch_size x dp_world_size`` rows
    and keep rows ``[dp_rank x local_batch_size, ...)``, so the global batch of a step does not
    depend on the DP degree, and its state resumes under any DP degree. ``drop_last``: a
    finite pass ends at its last full batch (under ``by_row`` a partial global batch would
    leave some ranks no rows at all). ``make_dataset``: what turns the rows into windows
    (called as ``TextDataset`` is; default: ``TextDataset``, reading ``data_format`` text).
    ``flag``: the config section messages name (``--validation`` for validation data).
    ``mix``: the datasets of ``--training.dataset_mix``, read in place of ``dataset`` (each
    as ``dataset`` would be) and interleaved by ``MixedDataset``. ``shuffle_seed``: read
    documents in a seeded random order, a new one each epoch (``TextDataset``).
    """
    by_row = sharding == "by_row"

    def windows_of(
        name: str, path: str | None, label: str, entry: str | None
    ) -> TextDataset | TokenWindows:
        data, text_key = open_dataset(name, path, data_format=data_format, flag=flag, entry=entry)
        reader = {
            "name": label,
            "seq_len": seq_len,
            "dp_rank": 0 if by_row else dp_rank,
            "dp_world_size": 1 if by_row else dp_world_size,
            "infinite": infinite,
            "flag": flag,
            "where": f"data-parallel rank {dp_rank} of {dp_world_size} (by_row)"
            if by_row
            else None,
            "shuffle_seed": shuffle_seed,
        }
        if isinstance(data, TokenFolder):
            data.check_tokenizer(tokenizer)
            return TokenWindows(data, **reader)
        make = make_dataset or functools.partial(TextDataset, text_key=text_key)
        return make(data, tokenizer=tokenizer, **reader)

    if mix:
        if not infinite:
            raise ValueError("a dataset mix is endless training data")
        text = MixedDataset(
            [windows_of(e.name, e.path, e.label, e.written) for e in mix],
            [e.label for e in mix],
            [e.weight for e in mix],
        )
    else:
        # Named as a mix entry would name it, so a mix naming it continues its state.
        text = windows_of(dataset, dataset_path, MixEntry(dataset, dataset_path, 1.0).label, None)
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

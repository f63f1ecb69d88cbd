"""Training windows read from pre-tokenized shards (``--training.dataset tokens``).

The folder's tokens are one stream, cut into windows of ``seq_len + 1`` tokens (inputs the
first ``seq_len``, labels the last ``seq_len``; the stream's last ``< seq_len + 1`` tokens are
left out each epoch). Nothing is tokenized and no document is parsed: a window is two slices of
memory-mapped shards at most. In the data's order the windows are the ones the text loader
packs from the same documents in its first epoch (it carries an epoch's last tokens into the
next; these windows leave them out). Each data-parallel rank reads a contiguous block of the
windows; ``--training.shuffle_seed`` permutes all windows each epoch (computed per index, no
table held) and each rank reads its block of the permutation. The position is a window index,
so a resume is exact and costs nothing.
"""

import bisect
import hashlib
from collections.abc import Iterator
from typing import Any

import numpy
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.components.token_shards import TokenFolder
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger


def contiguous_block(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` of ``n`` items split into ``world`` contiguous
    blocks, the first ``n % world`` one longer (as ``datasets``' ``split_dataset_by_node``
    splits documents)."""
    div, mod = divmod(n, world)
    start = div * rank + min(rank, mod)
    return start, start + div + (rank < mod)


def seed_text(seed: int | None) -> str:
    """How a shuffle seed reads in messages."""
    return (
        "without --training.shuffle_seed"
        if seed is None
        else f"with --training.shuffle_seed {seed}"
    )


def log_reloop(name: str, epoch: int, where: str) -> None:
    """Warn that a reader started epoch ``epoch`` (at epochs 1, 2, 4, 8, ...: not every pass)."""
    if epoch & (epoch - 1) == 0:
        logger.warning(
            f"Dataset {name} is being re-looped: epoch {epoch} of {where} (a dataset shorter "
            "than the run repeats)"
        )


def check_seed(name: str, saved: int | None, seed: int | None) -> None:
    """Refuse in one line a saved position of another shuffle order than this run's."""
    if saved != seed:
        raise ConfigError(
            f"dataloader state of {name} was saved {seed_text(saved)}, this run reads "
            f"{seed_text(seed)} (the saved position is in that order); resume "
            f"{seed_text(saved)} or pass --checkpoint.exclude_from_loading dataloader"
        )


_M64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """A 64-bit mixing function (splitmix64's finaliser)."""
    value = (value + 0x9E3779B97F4A7C15) & _M64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _M64
    return value ^ (value >> 31)


class Permutation:
    """A keyed pseudo-random permutation of ``range(count)``, computed per position: a 4-round
    Feistel network over the smallest even number of bits that holds ``count``, walked again
    while it lands outside (the domain is under 4x ``count``: 4 steps on average, a few dozen
    at worst, measured). Nothing of size
    ``count`` is held: a numpy permutation of 10^9 windows would take 8 GB per reader."""

    def __init__(self, count: int, key: int, start: int = 0, stop: int | None = None):
        """Positions ``[start, stop)`` of the permutation (a rank's block of it)."""
        self.count, self.key = count, key
        self.start, self.stop = start, count if stop is None else stop
        self._half = max(1, ((count - 1).bit_length() + 1) // 2)
        self._keys = [_mix64(key + r) for r in range(4)]

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(i)  # a walk from outside range(count) might never come back
        half, mask = self._half, (1 << self._half) - 1
        x = self.start + i
        while True:
            left, right = x >> half, x & mask
            for round_key in self._keys:
                left, right = right, left ^ (_mix64(right ^ round_key) & mask)
            x = (left << half) | right
            if x < self.count:
                return x


class TokenWindows(IterableDataset, Stateful):
    """This data-parallel rank's windows of a :class:`TokenFolder`, yielded as
    ``({"input": LongTensor[seq_len]}, labels: LongTensor[seq_len])`` like ``TextDataset``.
    ``infinite``: start another epoch at the end (else each ``iter()`` is one pass, what
    validation wants). Dataloader workers take every k-th window of the rank's block."""

    def __init__(
        self,
        folder: TokenFolder,
        *,
        name: str,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        flag: str = "--training",
        where: str | None = None,
        shuffle_seed: int | None = None,
    ):
        self.name = name
        self._folder = folder
        self._window = seq_len + 1
        self._count = folder.tokens // self._window
        self._where = where or f"data-parallel rank {dp_rank} of {dp_world_size}"
        if self._count < dp_world_size:
            raise ConfigError(
                f"{folder.label}: its {folder.tokens:,} tokens make "
                f"{self._count} windows of {flag}.seq_len {seq_len} + 1, fewer than the "
                f"{dp_world_size} data-parallel ranks; use a shorter {flag}.seq_len, fewer "
                "ranks or more data"
            )
        self._block = contiguous_block(self._count, dp_rank, dp_world_size)
        logger.info(
            f"Pre-tokenized {name}: {folder.tokens:,} tokens of {folder.documents:,} documents "
            f"in {len(folder.shards)} shard(s), {self._count:,} windows of {self._window}; "
            f"{self._where} reads {self._block[1] - self._block[0]:,} a pass"
        )
        self._flag = flag
        self._infinite = infinite
        self._shuffle_seed = shuffle_seed
        self._epoch = 0
        self._sample_idx = 0  # next index into this epoch's order
        # Shards mapped as windows reach them, in the reading process (a run of 10^13 tokens
        # has tens of thousands of shards; a worker maps only those it reads).
        self._arrays: dict[int, numpy.ndarray] = {}
        self._starts = numpy.cumsum([0] + [s.tokens for s in folder.shards]).tolist()

    def __getstate__(self) -> dict[str, Any]:
        # Dataloader workers map the shards themselves (a pickled memmap would be a copy).
        return {**self.__dict__, "_arrays": {}}

    def _windows_of_epoch(self) -> Any:
        """This rank's window indices in reading order: its block, or (shuffled) its block of
        this epoch's permutation of every window."""
        if self._shuffle_seed is None:
            return range(*self._block)
        # Keyed by the shards' contents, not the path as written (``./data/x`` and ``data/x``
        # must resume alike); the folders of a mix draw different orders.
        text = f"{self._shuffle_seed}/{self._epoch}/{self._folder.identity}"
        key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        return Permutation(self._count, key, *self._block)

    def check_readers(self, num_workers: int) -> None:
        """Refuse more dataloader workers than this rank has windows (a worker with none
        would never yield), before any worker starts."""
        block = self._block[1] - self._block[0]
        if num_workers > block:
            raise ConfigError(
                f"dataset {self.name} has {block} windows for {self._where}, fewer than its "
                f"{num_workers} dataloader workers; use --training.num_workers {block} or fewer"
            )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        info = get_worker_info()
        stride, offset = (info.num_workers, info.id) if info is not None else (1, 0)
        self.check_readers(stride)
        while True:
            order = self._windows_of_epoch()
            for i in range(self._sample_idx, len(order)):
                if i % stride == offset:
                    self._sample_idx = i + 1
                    yield self._read(int(order[i]))
            self._sample_idx = 0
            if not self._infinite:
                return
            self._epoch += 1
            log_reloop(self.name, self._epoch, self._where)

    def _read(self, window: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        start, stop = window * self._window, (window + 1) * self._window
        shard = bisect.bisect_right(self._starts, start) - 1
        pieces = []
        while start < stop:  # a window crosses into the next shard at most a few times
            local = start - self._starts[shard]
            if shard not in self._arrays:
                self._arrays[shard] = self._folder.array(shard)
            piece = self._arrays[shard][local : local + stop - start]
            pieces.append(piece)
            start += len(piece)
            shard += 1
        tokens = torch.from_numpy(numpy.concatenate(pieces).astype(numpy.int64))
        return {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.name,
            "format": "tokens",
            "shuffle_seed": self._shuffle_seed,
            "epoch": self._epoch,
            "sample_idx": self._sample_idx,
            "window_tokens": self._window,
            "data": self._folder.identity,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse in one line a saved position these windows cannot continue: a mix's, text
        documents', another shuffle seed's, another window length's or another folder's."""
        skip = "pass --checkpoint.exclude_from_loading dataloader"
        if "mix" in state:
            mix = [
                f"{label}:{w:g}" for label, w in zip(state["mix"], state["weights"], strict=True)
            ]
            raise ConfigError(
                f"dataloader state was saved reading --training.dataset_mix {' '.join(mix)}, "
                f"this run reads {self.name} alone; resume with a mix (one that names "
                f"{self.name} continues it where it was) or {skip}"
            )
        if state.get("format", "text") != "tokens":
            raise ConfigError(
                f"dataloader state of {state.get('dataset', 'the data')} was saved reading "
                f"documents (--training.data_format {state.get('format', 'text')}), this run "
                f"reads pre-tokenized windows ({self.name}); the position does not carry over: "
                f"{skip}"
            )
        check_seed(self.name, state.get("shuffle_seed"), self._shuffle_seed)
        if state["window_tokens"] != self._window:
            raise ConfigError(
                f"dataloader state of {self.name} was saved with {self._flag}.seq_len "
                f"{state['window_tokens'] - 1}, this run has {self._window - 1} (the position "
                f"counts windows); resume with {state['window_tokens'] - 1} or {skip}"
            )
        if state["data"] != self._folder.identity:
            raise ConfigError(
                f"dataloader state of {self.name} was saved reading other tokens than "
                f"{self._folder.label} holds now (the shards changed); {skip}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self._epoch = state["epoch"]
        self._sample_idx = state["sample_idx"]

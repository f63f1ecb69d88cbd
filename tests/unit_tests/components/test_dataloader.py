"""Tests for the datasets registry, the token-window packing and the resumable DP-aware loader.

Everything reads small files written under ``tmp_path`` (or the bundled corpus) through the real
Hugging Face ``datasets`` code; the hub is never contacted and nothing is cached outside
``tmp_path``.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import datasets.config
import huggingface_hub.constants
import pytest
import torch

from torchtitan.components import local_rows
from torchtitan.components.data_sources import DATASETS, DatasetSpec, load_files, open_dataset
from torchtitan.components.dataloader import (
    ParallelAwareDataloader,
    TextDataset,
    build_dataloader,
)
from torchtitan.components.local_rows import LocalRows
from torchtitan.components.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    Llama3Tokenizer,
    build_tokenizer,
)
from torchtitan.config.errors import ConfigError
from torchtitan.tools.logging import logger

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]

_WORDS = (
    "the assert statement raises an error when its expression is false and the module "
    "imports a function that returns every value of a list in order"
).split()


@pytest.fixture(autouse=True)
def offline_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub access and every ``datasets`` cache under ``tmp_path``.

    ``datasets`` and ``huggingface_hub`` read these variables once, at import, which happened
    before this fixture; so the module-level copies are patched as well as the environment.
    """
    home = tmp_path / "hf_home"
    cache = home / "datasets"
    for name, value in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(cache),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HOME", str(home))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_CACHE_HOME", str(home))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_MODULES_CACHE", home / "modules")
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", cache / "downloads")
    monkeypatch.setattr(
        datasets.config, "EXTRACTED_DATASETS_PATH", cache / "downloads" / "extracted"
    )


@pytest.fixture(scope="module")
def tokenizer() -> Llama3Tokenizer:
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


class IdTokenizer:
    """Encodes ``"doc <id> ..."`` as ``[bos, id, id, eos]`` so document ids survive packing."""

    bos_id = 1000
    eos_id = 1001

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        doc_id = int(text.split()[1])
        return [self.bos_id] * add_bos + [doc_id, doc_id] + [self.eos_id] * add_eos


def _doc(doc_id: int, num_words: int) -> str:
    words = (_WORDS[(doc_id * 7 + k) % len(_WORDS)] for k in range(num_words))
    return f"doc {doc_id} " + " ".join(words)


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _files_loader(path: Path, tokenizer: Any, **kwargs: Any) -> ParallelAwareDataloader:
    args = dict(seq_len=16, local_batch_size=2, dp_rank=0, dp_world_size=1, infinite=False)
    args.update(kwargs)
    return build_dataloader(dataset="files", dataset_path=str(path), tokenizer=tokenizer, **args)


def _take(it: Iterator[Batch], n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


def _windows(batches: list[Batch]) -> list[list[int]]:
    """Each packed row as its ``seq_len + 1`` tokens: the inputs plus the last label."""
    rows = []
    for inputs, labels in batches:
        for x, y in zip(inputs["input"], labels, strict=True):
            rows.append(x.tolist() + y[-1:].tolist())
    return rows


def _flat(batches: list[Batch]) -> list[int]:
    return [token for window in _windows(batches) for token in window]


def _assert_same_batches(actual: list[Batch], expected: list[Batch]) -> None:
    assert len(actual) == len(expected)
    for (x, y), (ex, ey) in zip(actual, expected, strict=True):
        torch.testing.assert_close(x["input"], ex["input"], rtol=0, atol=0)
        torch.testing.assert_close(y, ey, rtol=0, atol=0)


def _saved(state: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The state as a checkpoint gives it back: through torch.save and a weights-only load."""
    path = tmp_path / "dataloader_state.pt"
    torch.save(state, path)
    return torch.load(path, weights_only=True)


def _check_resume(
    make_loader: Callable[[], ParallelAwareDataloader], n: int, m: int, tmp_path: Path
) -> dict[str, Any]:
    """Take ``n`` batches, save, take ``m`` more; a fresh loader resumed from the save must
    yield the same ``m``. Returns the saved state."""
    loader = make_loader()
    it = iter(loader)
    _take(it, n)
    saved = _saved(loader.state_dict(), tmp_path)
    reference = _take(it, m)

    resumed = make_loader()
    resumed.load_state_dict(saved)
    _assert_same_batches(_take(iter(resumed), m), reference)
    return saved


def _json_stream(path: str) -> datasets.IterableDataset:
    return datasets.load_dataset("json", data_files=path, split="train", streaming=True)


# --- packing ---------------------------------------------------------------------------------


def test_windows_are_shifted_and_concatenate_to_the_token_stream(
    tmp_path: Path, tokenizer: Llama3Tokenizer
) -> None:
    texts = [_doc(i, num_words=3 + 5 * i) for i in range(6)]
    path = _write_jsonl(tmp_path / "docs.jsonl", texts)
    seq_len, batch = 16, 2
    batches = list(_files_loader(path, tokenizer, seq_len=seq_len, local_batch_size=batch))

    for k, (inputs, labels) in enumerate(batches):
        rows = batch if k < len(batches) - 1 else inputs["input"].shape[0]
        assert inputs["input"].shape == labels.shape == (rows, seq_len)
        assert inputs["input"].dtype == labels.dtype == torch.long
        assert torch.equal(labels[:, :-1], inputs["input"][:, 1:])

    expected = [t for text in texts for t in tokenizer.encode(text, add_bos=True, add_eos=True)]
    window = seq_len + 1
    full_windows = len(expected) // window
    assert len(expected) % window != 0, "choose texts that leave a partial last window"
    assert len(_windows(batches)) == full_windows
    stream = _flat(batches)
    assert stream == expected[: full_windows * window]

    # BOS starts and EOS ends each document, and nowhere else.
    starts, ends, offset = [], [], 0
    for text in texts:
        starts.append(offset)
        offset += len(tokenizer.encode(text, add_bos=True, add_eos=True))
        ends.append(offset - 1)
    covered = len(stream)
    assert [i for i, t in enumerate(stream) if t == tokenizer.bos_id] == [
        s for s in starts if s < covered
    ]
    assert [i for i, t in enumerate(stream) if t == tokenizer.eos_id] == [
        e for e in ends if e < covered
    ]


# --- data-parallel sharding --------------------------------------------------------------------


@pytest.mark.parametrize(("dp_world_size", "num_docs"), [(2, 11), (3, 10), (3, 3)])
def test_dp_ranks_read_disjoint_shards_covering_all_documents(
    tmp_path: Path, dp_world_size: int, num_docs: int
) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 2) for i in range(num_docs)])
    seen = []
    for rank in range(dp_world_size):
        # seq_len 3: each window is exactly one stub-tokenized document [bos, id, id, eos].
        loader = _files_loader(
            path, IdTokenizer(), seq_len=3, dp_rank=rank, dp_world_size=dp_world_size
        )
        windows = _windows(list(loader))
        assert all(w[0] == IdTokenizer.bos_id and w[3] == IdTokenizer.eos_id for w in windows)
        seen.append([w[1] for w in windows])

    for a in range(dp_world_size):
        assert seen[a] == sorted(seen[a])  # each shard keeps document order
        for b in range(a + 1, dp_world_size):
            assert not set(seen[a]) & set(seen[b])
    assert sorted(i for ids in seen for i in ids) == list(range(num_docs))
    sizes = [len(ids) for ids in seen]
    assert max(sizes) - min(sizes) <= 1


def test_dp_shards_with_the_real_tokenizer(tmp_path: Path, tokenizer: Llama3Tokenizer) -> None:
    # Every document is longer than a window, so each one's "doc <id>" header lands in a full
    # window even when the shard's last partial window is dropped.
    texts = [_doc(i, num_words=20 + 3 * (i % 4)) for i in range(10)]
    path = _write_jsonl(tmp_path / "docs.jsonl", texts)
    seen = []
    for rank in range(3):
        loader = _files_loader(path, tokenizer, seq_len=12, dp_rank=rank, dp_world_size=3)
        stream = _flat(list(loader))
        ids = [
            int(i) for i in re.findall(r"<\|begin_of_text\|>doc (\d+) ", tokenizer.decode(stream))
        ]
        assert ids, f"rank {rank} read nothing"
        expected = [t for i in ids for t in tokenizer.encode(texts[i], add_bos=True, add_eos=True)]
        assert stream == expected[: len(stream)]
        assert len(expected) - len(stream) < 13
        seen.append(ids)
    assert all(not set(a) & set(b) for k, a in enumerate(seen) for b in seen[k + 1 :])
    assert sorted(i for ids in seen for i in ids) == list(range(10))


# --- exact resume ------------------------------------------------------------------------------


def test_resume_map_style_with_a_partly_consumed_document(
    tmp_path: Path, tokenizer: Llama3Tokenizer
) -> None:
    texts = [_doc(i, num_words=10 + 7 * (i % 3)) for i in range(12)]
    path = _write_jsonl(tmp_path / "docs.jsonl", texts)

    def make() -> ParallelAwareDataloader:
        return _files_loader(path, tokenizer, seq_len=16, infinite=True)

    saved = _check_resume(make, n=3, m=5, tmp_path=tmp_path)
    state = saved["dp_rank_0"]["dataset_state"]
    # The save fell inside a document: its tail waits in the buffer, not at a BOS.
    assert state["token_buffer"] and state["token_buffer"][0] != tokenizer.bos_id
    assert 0 < state["sample_idx"] < len(texts)


def test_resume_streaming_dataset(
    tmp_path: Path, tokenizer: Llama3Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = [_doc(i, num_words=10 + 7 * (i % 3)) for i in range(12)]
    _write_jsonl(tmp_path / "data" / "part0.jsonl", texts[:7])
    _write_jsonl(tmp_path / "data" / "part1.jsonl", texts[7:])
    monkeypatch.setitem(DATASETS, "json_stream", DatasetSpec(path=None, loader=_json_stream))

    def make() -> ParallelAwareDataloader:
        return build_dataloader(
            dataset="json_stream",
            dataset_path=str(tmp_path / "data" / "*.jsonl"),
            tokenizer=tokenizer,
            seq_len=16,
            local_batch_size=2,
            dp_rank=0,
            dp_world_size=1,
        )

    data, _ = open_dataset("json_stream", str(tmp_path / "data" / "*.jsonl"))
    assert isinstance(data, datasets.IterableDataset) and data.num_shards == 2
    saved = _check_resume(make, n=3, m=5, tmp_path=tmp_path)
    assert "stream" in saved["dp_rank_0"]["dataset_state"]
    assert saved["dp_rank_0"]["dataset_state"]["token_buffer"]


def test_streaming_text_dataset_built_directly_resumes(
    tmp_path: Path, tokenizer: Llama3Tokenizer
) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 15) for i in range(8)])

    def make() -> TextDataset:
        return TextDataset(_json_stream(str(path)), name="s", tokenizer=tokenizer, seq_len=8)

    first = make()
    it = iter(first)
    _take(it, 4)
    state = first.state_dict()
    reference = _take(it, 6)
    second = make()
    second.load_state_dict(state)
    resumed = _take(iter(second), 6)
    for (x, y), (ex, ey) in zip(resumed, reference, strict=True):
        assert torch.equal(x["input"], ex["input"]) and torch.equal(y, ey)


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_infinite_mode_reloops_and_resumes_across_the_epoch_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    num_docs = 5
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 2) for i in range(num_docs)])
    monkeypatch.setitem(DATASETS, "json_stream", DatasetSpec(path=None, loader=_json_stream))
    dataset = "files" if kind == "map" else "json_stream"

    def make() -> ParallelAwareDataloader:
        # Windows of 5 tokens over 4-token documents: windows straddle documents and epochs.
        return build_dataloader(
            dataset=dataset,
            dataset_path=str(path),
            tokenizer=IdTokenizer(),
            seq_len=4,
            local_batch_size=1,
            dp_rank=0,
            dp_world_size=1,
            infinite=True,
        )

    one_epoch = [
        t
        for i in range(num_docs)
        for t in IdTokenizer().encode(_doc(i, 2), add_bos=True, add_eos=True)
    ]
    loader = make()
    stream = _flat(_take(iter(loader), 3 * num_docs))  # 75 tokens: 3.75 epochs
    assert stream == (one_epoch * 4)[: len(stream)]
    assert loader.dataset.state_dict()["epoch"] == 3

    # 5 windows = 25 tokens > one 20-token epoch: the save happens after the loop restarted.
    saved = _check_resume(make, n=5, m=7, tmp_path=tmp_path)
    assert saved["dp_rank_0"]["dataset_state"]["epoch"] == 1


def test_loading_state_from_another_dp_degree_is_refused(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 2) for i in range(6)])
    loader = _files_loader(path, IdTokenizer(), seq_len=3, dp_world_size=2)
    next(iter(loader))
    state = loader.state_dict()

    other = _files_loader(path, IdTokenizer(), seq_len=3, dp_world_size=3)
    with pytest.raises(ValueError, match="--checkpoint.exclude_from_loading dataloader"):
        other.load_state_dict(state)

    wrong_rank = _files_loader(path, IdTokenizer(), seq_len=3, dp_rank=1, dp_world_size=2)
    with pytest.raises(ValueError, match="dp_rank_1"):
        wrong_rank.load_state_dict(state)

    # An excluded dataloader arrives as an empty state: nothing to load, start from the top.
    fresh = _files_loader(path, IdTokenizer(), seq_len=3, dp_world_size=2)
    fresh.load_state_dict({})
    assert _windows([next(iter(fresh))])[0][1] == 0


def _global_rows(loaders: list[ParallelAwareDataloader], steps: int) -> list[list[int]]:
    """The global batches of ``steps`` steps: every rank's rows of a step, in rank order."""
    iters = [iter(loader) for loader in loaders]
    rows = []
    for _ in range(steps):
        for it in iters:
            rows.extend(_windows([next(it)]))
    return rows


def _no_seed(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _no_seed(v) for k, v in state.items() if k != "_base_seed"}
    return state


@pytest.mark.parametrize("num_workers", [0, 2])
def test_by_row_state_resumes_under_any_dp_degree(tmp_path: Path, num_workers: int) -> None:
    """by_row: a state saved by 2 ranks resumes 4 ranks (and 1) exactly where the global batch
    stream stood, whatever the split of the global batch of 4 rows."""
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 3 + i % 5) for i in range(40)])

    def make(dp_world_size: int, rank: int) -> ParallelAwareDataloader:
        return _files_loader(
            path,
            IdTokenizer(),
            seq_len=3,
            local_batch_size=4 // dp_world_size,
            dp_rank=rank,
            dp_world_size=dp_world_size,
            sharding="by_row",
            num_workers=num_workers,
            infinite=True,
        )

    reference = _global_rows([make(1, 0)], 7)
    two = [make(2, r) for r in range(2)]
    assert _global_rows(two, 3) == reference[:12]
    saved = [_saved(loader.state_dict(), tmp_path) for loader in two]
    # What lets any degree resume: the ranks' states agree, but for the loaders' own
    # worker seed base (unused: reading is deterministic).
    assert _no_seed(saved[0]["dp_rank_0"]) == _no_seed(saved[1]["dp_rank_1"])

    for degree in (4, 1):
        resumed = [make(degree, r) for r in range(degree)]
        for rank, loader in enumerate(resumed):
            loader.load_state_dict(saved[rank % 2])
        assert _global_rows(resumed, 4) == reference[12:], degree


def test_by_document_state_of_one_rank_resumes_by_row_ranks(tmp_path: Path) -> None:
    """One rank reads the whole stream under either sharding, so its state resumes a by_row
    run of any degree; a by_row state does not resume by_document ranks of another degree."""
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 4) for i in range(20)])
    one = _files_loader(path, IdTokenizer(), seq_len=3, local_batch_size=2, infinite=True)
    reference = _global_rows([one], 5)
    one = _files_loader(path, IdTokenizer(), seq_len=3, local_batch_size=2, infinite=True)
    _global_rows([one], 2)
    state = _saved(one.state_dict(), tmp_path)
    rows = [
        _files_loader(path, IdTokenizer(), seq_len=3, local_batch_size=1, dp_rank=r,
                      dp_world_size=2, sharding="by_row", infinite=True)
        for r in range(2)
    ]  # fmt: skip
    for loader in rows:
        loader.load_state_dict(state)
    assert _global_rows(rows, 3) == reference[4:]

    by_row = _saved(rows[0].state_dict(), tmp_path)
    by_document = _files_loader(path, IdTokenizer(), seq_len=3, dp_world_size=2)
    with pytest.raises(ValueError, match="--training.data_sharding by_row, this run has by_doc"):
        by_document.load_state_dict(by_row)


def test_a_change_of_worker_count_is_refused_in_one_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 4) for i in range(20)])
    loader = _files_loader(path, IdTokenizer(), seq_len=3, infinite=True)
    _global_rows([loader], 2)
    other = _files_loader(path, IdTokenizer(), seq_len=3, num_workers=2, infinite=True)
    with pytest.raises(ValueError, match="--training.num_workers 0, this run has 2; resume with 0"):
        other.load_state_dict(_saved(loader.state_dict(), tmp_path))


def test_by_row_windows_regrouped_by_workers_are_said_on_resume(tmp_path: Path, caplog) -> None:
    """Workers make whole batches from their own share of the stream: a by_row state resumed
    at another number of rows per batch (2 ranks of 2 rows -> 1 process of 2) continues, with
    one line saying its steps are grouped otherwise; at the same rows (1 process of 4) or
    without workers it says nothing."""
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 4) for i in range(40)])

    def make(dp: int, rank: int, lbs: int, workers: int = 2) -> ParallelAwareDataloader:
        return _files_loader(
            path, IdTokenizer(), seq_len=3, local_batch_size=lbs, dp_rank=rank,
            dp_world_size=dp, sharding="by_row", num_workers=workers, infinite=True,
        )  # fmt: skip

    caplog.set_level(logging.INFO, logger=logger.name)
    for workers in (2, 0):
        two = [make(2, r, 2, workers) for r in range(2)]
        _global_rows(two, 2)
        saved = _saved(two[0].state_dict(), tmp_path)
        caplog.clear()
        make(1, 0, 4, workers).load_state_dict(saved)
        assert "grouped into steps otherwise" not in caplog.text
        make(1, 0, 2, workers).load_state_dict(saved)
        said = "saved reading 4 rows per batch continues at 2" in caplog.text
        assert said == bool(workers), workers
        same_degree = _saved(make(1, 0, 2, workers).state_dict(), tmp_path)
        make(1, 0, 4, workers).load_state_dict(same_degree)  # another local_batch_size
        said = "saved reading 2 rows per batch continues at 4" in caplog.text
        assert said == bool(workers), workers


def test_a_resume_on_other_data_is_warned_about(tmp_path: Path, caplog) -> None:
    """A saved position continues on a file moved elsewhere (another name), with a warning;
    on a file with other documents (another count) too, saying what that does: one rank goes
    on at its document, data-parallel blocks move. The same file says nothing."""
    texts = [_doc(i, 4) for i in range(20)]
    path = _write_jsonl(tmp_path / "a.jsonl", texts)

    def saved_after_two(dp: int) -> dict[str, Any]:
        loader = _files_loader(path, IdTokenizer(), seq_len=3, dp_world_size=dp, infinite=True)
        _global_rows([loader], 2)
        return _saved(loader.state_dict(), tmp_path)

    one, of_two = saved_after_two(1), saved_after_two(2)
    _files_loader(path, IdTokenizer(), seq_len=3).load_state_dict(one)
    assert "dataloader state" not in caplog.text and "documents" not in caplog.text
    moved = _write_jsonl(tmp_path / "b.jsonl", texts)
    _files_loader(moved, IdTokenizer(), seq_len=3).load_state_dict(one)
    assert (
        f"saved reading files={path}, this run reads files={moved}: it continues at document"
        in (caplog.text)
    )
    assert "had 20 documents" not in caplog.text
    grown = _write_jsonl(tmp_path / "a.jsonl", texts + [_doc(20, 4)])
    _files_loader(grown, IdTokenizer(), seq_len=3).load_state_dict(one)
    assert (
        f"dataset files={path} had 20 documents when the dataloader state was saved and has 21 "
        in (caplog.text)
    )
    assert "now: it continues at document" in caplog.text
    _files_loader(grown, IdTokenizer(), seq_len=3, dp_world_size=2).load_state_dict(of_two)
    assert "block of documents (or the shuffled order) moved" in caplog.text


# --- c4 through a local mirror ------------------------------------------------------------------

_C4_README = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/c4-train.*.json.gz
  - split: validation
    path: en/c4-validation.*.json.gz
---
"""


def _write_c4_file(path: Path, texts: list[str]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for k, text in enumerate(texts):
            record = {"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://e/{k}"}
            f.write(json.dumps(record) + "\n")


@pytest.fixture
def c4_mirror(tmp_path: Path) -> Path:
    """A folder laid out like the hub repo allenai/c4 (two train shards, one validation)."""
    root = tmp_path / "c4"
    (root / "en").mkdir(parents=True)
    _write_c4_file(root / "en" / "c4-train.00000-of-00002.json.gz", [_doc(i, 30) for i in range(6)])
    _write_c4_file(
        root / "en" / "c4-train.00001-of-00002.json.gz", [_doc(i, 30) for i in range(6, 11)]
    )
    _write_c4_file(
        root / "en" / "c4-validation.00000-of-00001.json.gz",
        [_doc(i, 30) for i in range(100, 103)],
    )
    (root / "README.md").write_text(_C4_README)
    return root


def _c4_loader(
    root: Path, tokenizer: Any, dataset: str = "c4", **kwargs: Any
) -> ParallelAwareDataloader:
    args = dict(seq_len=3, local_batch_size=2, dp_rank=0, dp_world_size=1, infinite=False)
    args.update(kwargs)
    return build_dataloader(dataset=dataset, dataset_path=str(root), tokenizer=tokenizer, **args)


def test_c4_streams_from_a_local_mirror(c4_mirror: Path) -> None:
    data, text_key = open_dataset("c4", str(c4_mirror))
    assert isinstance(data, datasets.IterableDataset)
    assert data.num_shards == 2 and text_key == "text"

    ids = [w[1] for w in _windows(list(_c4_loader(c4_mirror, IdTokenizer())))]
    assert ids == list(range(11))

    validation = [
        w[1] for w in _windows(list(_c4_loader(c4_mirror, IdTokenizer(), "c4_validation")))
    ]
    assert validation == [100, 101, 102]


def test_stream_workers_re_loop_alike_and_resume_exactly(tmp_path: Path) -> None:
    """Two workers over a stream of two shards, over several epochs: every run reads the same
    batches and a resume continues exactly (a rewind used to load the unsplit stream's first
    position into a worker, which then read whatever shards it happened to)."""
    docs = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(7)]})

    def loader() -> ParallelAwareDataloader:
        text = TextDataset(
            docs.to_iterable_dataset(num_shards=2), name="s", tokenizer=IdTokenizer(), seq_len=3
        )
        return ParallelAwareDataloader(
            text, dp_rank=0, dp_world_size=1, batch_size=2, num_workers=2
        )

    first, second = loader(), loader()
    a, b = iter(first), iter(second)
    taken = [next(a) for _ in range(9)]
    state = _saved(first.state_dict(), tmp_path)
    rest = [next(a) for _ in range(9)]
    _assert_same_batches([next(b) for _ in range(18)], taken + rest)
    resumed = loader()
    resumed.load_state_dict(state)
    _assert_same_batches(_take(iter(resumed), 9), rest)


def test_an_unreachable_hub_dataset_is_one_line() -> None:
    with pytest.raises(ConfigError, match="--training.dataset c4: cannot reach allenai/c4 .*"
                       "point --training.dataset_path at a local copy"):  # fmt: skip
        open_dataset("c4", None)


def test_a_streamed_dataset_is_not_shuffled(c4_mirror: Path) -> None:
    with pytest.raises(ConfigError, match="--training.shuffle_seed: dataset c4=.* is streamed"):
        _c4_loader(c4_mirror, IdTokenizer(), shuffle_seed=1)


@pytest.mark.parametrize("dp_world_size", [2, 3])
def test_c4_dp_shards_are_disjoint(c4_mirror: Path, dp_world_size: int) -> None:
    seen = [
        {
            w[1]
            for w in _windows(
                list(_c4_loader(c4_mirror, IdTokenizer(), dp_rank=r, dp_world_size=dp_world_size))
            )
        }
        for r in range(dp_world_size)
    ]
    assert all(not a & b for k, a in enumerate(seen) for b in seen[k + 1 :])
    assert set().union(*seen) == set(range(11))
    if dp_world_size == 2:  # as many ranks as files: each rank streams whole files
        assert sorted(map(sorted, seen)) == [list(range(6)), list(range(6, 11))]


def test_c4_resume(c4_mirror: Path, tokenizer: Llama3Tokenizer, tmp_path: Path) -> None:
    def make() -> ParallelAwareDataloader:
        return _c4_loader(
            c4_mirror, tokenizer, seq_len=16, dp_rank=1, dp_world_size=2, infinite=True
        )

    saved = _check_resume(make, n=4, m=6, tmp_path=tmp_path)
    assert saved["dp_world_size"] == 2 and "dp_rank_1" in saved


# --- opening datasets ---------------------------------------------------------------------------


def _write_json(path: Path) -> Path:
    path.write_text(json.dumps([{"text": "doc 0 a"}, {"text": "doc 1 b"}]))
    return path


def _write_parquet(path: Path) -> Path:
    datasets.Dataset.from_dict({"text": ["doc 0 a", "doc 1 b"]}).to_parquet(str(path))
    return path


def _write_txt(path: Path) -> Path:
    path.write_text("doc 0 a\nsecond line\n\ndoc 1 b\n\ndoc 2 c\n")
    return path


def _write_folder(path: Path) -> Path:
    _write_jsonl(path / "b.jsonl", ["doc 1 b"])
    _write_jsonl(path / "a.jsonl", ["doc 0 a"])
    _write_jsonl(path / "nested" / "c.jsonl", ["doc 2 c"])
    (path / "README.md").write_text("not data")
    return path


def _write_glob(path: Path) -> Path:
    _write_jsonl(path / "train-0.jsonl", ["doc 0 a"])
    _write_jsonl(path / "train-1.jsonl", ["doc 1 b"])
    _write_jsonl(path / "other.jsonl", ["doc 9 z"])
    return path / "train-*.jsonl"


def _write_gzip_jsonl(path: Path) -> Path:
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"text": "doc 0 a"}) + "\n" + json.dumps({"text": "doc 1 b"}) + "\n")
    return path


@pytest.mark.parametrize(
    ("name", "write", "expected"),
    [
        ("docs.json", _write_json, ["doc 0 a", "doc 1 b"]),
        ("docs.jsonl", lambda p: _write_jsonl(p, ["doc 0 a", "doc 1 b"]), ["doc 0 a", "doc 1 b"]),
        ("docs.parquet", _write_parquet, ["doc 0 a", "doc 1 b"]),
        ("docs.txt", _write_txt, ["doc 0 a\nsecond line", "doc 1 b", "doc 2 c"]),
        ("folder", _write_folder, ["doc 0 a", "doc 1 b", "doc 2 c"]),
        ("shards", _write_glob, ["doc 0 a", "doc 1 b"]),
        ("docs.jsonl.gz", _write_gzip_jsonl, ["doc 0 a", "doc 1 b"]),
    ],
)
def test_files_loader_formats(
    tmp_path: Path,
    name: str,
    write: Callable[[Path], Path],
    expected: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write(tmp_path / name)
    data = load_files(str(path))
    assert isinstance(data, datasets.Dataset if name.endswith(".parquet") else LocalRows)
    assert [row["text"].strip() for row in data] == expected
    # The rows ``datasets`` reads, as large files are read.
    monkeypatch.setattr(local_rows, "IN_MEMORY_BYTES", 0)
    through_datasets = load_files(str(path))
    assert isinstance(through_datasets, datasets.Dataset)
    assert list(data) == list(through_datasets)

    # And through the dataloader: one document per window with the stub tokenizer.
    loader = _files_loader(path, IdTokenizer(), seq_len=3, local_batch_size=1)
    assert [w[1] for w in _windows(list(loader))] == list(range(len(expected)))


def test_files_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--training.dataset_path"):
        load_files(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="--training.dataset_path"):
        load_files(str(tmp_path / "nothing-*.jsonl"))
    _write_jsonl(tmp_path / "mixed" / "a.jsonl", ["doc 0"])
    (tmp_path / "mixed" / "b.txt").write_text("doc 1")
    with pytest.raises(ValueError, match=r"mixes file types \(json, text\); point it at files"):
        load_files(str(tmp_path / "mixed"))
    (tmp_path / "rows.csv").write_text("text\ndoc 0\n")
    with pytest.raises(ValueError, match=r"rows.csv has an unknown type; use files ending in one"):
        load_files(str(tmp_path / "rows.csv"))


def test_open_dataset_errors() -> None:
    with pytest.raises(ValueError, match="not registered") as info:
        open_dataset("no_such_dataset", None)
    assert all(name in str(info.value) for name in DATASETS)
    with pytest.raises(ValueError, match="--training.dataset_path"):
        open_dataset("files", None)


def test_bundled_dataset_opens_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert not Path(DATASETS["python_docs"].path).exists()  # relative, and not here
    data, text_key = open_dataset("python_docs", None)
    assert isinstance(data, LocalRows) and len(data) > 0
    assert text_key == "text" and data[0][text_key]


# --- known bugs ---------------------------------------------------------------------------------


def test_dataloader_workers_do_not_duplicate_documents(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 2) for i in range(6)])
    loader = _files_loader(path, IdTokenizer(), seq_len=3, local_batch_size=1, num_workers=2)
    assert sorted(w[1] for w in _windows(list(loader))) == list(range(6))


def test_streaming_state_saved_right_after_resume_keeps_position(
    tmp_path: Path, tokenizer: Llama3Tokenizer
) -> None:
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 15) for i in range(10)])

    def make() -> ParallelAwareDataloader:
        text = TextDataset(_json_stream(str(path)), name="s", tokenizer=tokenizer, seq_len=16)
        return ParallelAwareDataloader(text, dp_rank=0, dp_world_size=1, batch_size=2)

    loader = make()
    it = iter(loader)
    _take(it, 3)
    saved = _saved(loader.state_dict(), tmp_path)
    reference = _take(it, 4)

    resumed = make()
    resumed.load_state_dict(saved)
    resaved = _saved(resumed.state_dict(), tmp_path)  # e.g. a checkpoint at the resume step

    again = make()
    again.load_state_dict(resaved)
    _assert_same_batches(_take(iter(again), 4), reference)


class _Spinning(Exception):
    pass


def test_infinite_loader_over_an_empty_shard_fails_instead_of_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    relooped = 0

    def count_reloops(message: str, *args: Any, **kwargs: Any) -> None:
        nonlocal relooped
        relooped += 1
        if relooped > 100:
            raise _Spinning(message)

    monkeypatch.setattr(logger, "warning", count_reloops)  # the re-loop warning's logger
    path = _write_jsonl(tmp_path / "docs.jsonl", [_doc(i, 2) for i in range(2)])
    # Three ranks, two streamed documents: rank 2 is assigned none of them.
    with pytest.raises(Exception) as info:
        text = TextDataset(
            _json_stream(str(path)),
            name="s",
            tokenizer=IdTokenizer(),
            seq_len=3,
            dp_rank=2,
            dp_world_size=3,
        )
        next(iter(ParallelAwareDataloader(text, dp_rank=2, dp_world_size=3, batch_size=1)))
    assert not isinstance(info.value, _Spinning), f"re-looped {relooped} times over no data"

"""Small local files are read from memory as ``datasets`` reads them (the same rows, fields
and shards), without importing it; large ones still go through it."""

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from datasets.distributed import split_dataset_by_node

from torchtitan.components import local_rows
from torchtitan.components.data_sources import load_files, open_dataset
from torchtitan.components.local_rows import LocalRows
from torchtitan.config.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``datasets``' Arrow cache of the files under this test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def _both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[LocalRows, datasets.Dataset]:
    ours = load_files(str(path))
    with monkeypatch.context() as m:
        m.setattr(local_rows, "IN_MEMORY_BYTES", 0)  # as a large file is read
        theirs = load_files(str(path))
    assert isinstance(ours, LocalRows) and isinstance(theirs, datasets.Dataset)
    return ours, theirs


def test_json_lines_rows_and_fields_are_datasets_own(tmp_path, monkeypatch):
    """A byte-order mark, Windows line ends, blank lines, a field some rows lack (None there),
    a column of ints and floats (floats, as Arrow reads it), nested values."""
    rows = [
        {"text": "first\r\nline", "id": 1, "meta": {"lang": "en"}},
        {"text": "second", "id": 2.5, "tags": ["a", "b"]},
        {"text": "", "id": 3, "meta": {"lang": "fr"}},
    ]
    lines = "\r\n".join(json.dumps(r) for r in rows[:2]) + "\r\n\r\n" + json.dumps(rows[2])
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + lines.encode())
    ours, theirs = _both(path, monkeypatch)
    assert list(ours) == list(theirs)
    assert list(ours.features) == list(theirs.features)
    for key in ("text", "id"):
        assert ours.features[key].dtype == theirs.features[key].dtype
    assert ours[1]["meta"] is None and ours[0]["tags"] is None


@pytest.mark.parametrize(
    "content",
    [
        [{"text": "a", "n": 1}, {"text": "b", "n": 2}],  # a list of objects
        ["a", "b c"],  # a list of strings: text rows
    ],
)
def test_a_json_list_reads_as_datasets_reads_it(tmp_path, monkeypatch, content):
    path = tmp_path / "docs.json"
    path.write_text(json.dumps(content))
    ours, theirs = _both(path, monkeypatch)
    assert list(ours) == list(theirs)


def test_text_paragraphs_are_datasets_own(tmp_path, monkeypatch):
    path = tmp_path / "book.txt"
    path.write_text("one\ntwo\n\n\nthree\r\n\r\nfour\n\n")
    ours, theirs = _both(path, monkeypatch)
    assert list(ours) == list(theirs)
    assert [r["text"] for r in ours] == ["one\ntwo", "\nthree", "four"]


@pytest.mark.parametrize(("n", "world"), [(7, 3), (2, 2), (10, 4)])
def test_shards_are_split_dataset_by_nodes(n, world):
    rows = [{"text": f"doc {i}"} for i in range(n)]
    ours = LocalRows(rows, local_rows._features(rows))
    theirs = datasets.Dataset.from_list(rows)
    for rank in range(world):
        assert list(ours.shard(rank, world)) == list(split_dataset_by_node(theirs, rank, world))


def test_batches_are_columns_as_datasets_gives_them(tmp_path, monkeypatch):
    """What ``scripts/pretokenize.py`` reads (``Dataset.iter``)."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}", "i": i}) + "\n" for i in range(5)))
    ours, theirs = _both(path, monkeypatch)
    assert list(ours.iter(batch_size=2)) == list(theirs.iter(batch_size=2))


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("bad.jsonl", '{"text": "a"}\n\n{"text": \n', r"bad.jsonl, line 3 is not valid JSON"),
        ("list.jsonl", '{"text": "a"}\n["b"]\n', r"list.jsonl, line 2 is a JSON list, not an obj"),
        ("items.json", '["a", 5]', r"items.json: item 1 of its list is int, not an object or"),
        ("cut.json", '[{"text": "a"}', r"cut.json is not valid JSON"),
        ("latin1.txt", b"caf\xe9", r"latin1.txt is not UTF-8 text"),
    ],
)
def test_bad_files_are_refused_in_one_line_naming_the_place(tmp_path, name, content, expected):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"^--training.dataset_path {path}: .*{expected}"):
        load_files(str(path))


def test_a_column_of_mixed_types_is_left_to_each_rows_check(tmp_path):
    """Ints refuse the file when it opens; a mix passes, and the row holding an int is refused
    when read (``TextDataset``: a int as 'text', not text)."""
    ints = tmp_path / "ints.jsonl"
    ints.write_text('{"text": 5}\n{"text": 6}\n')
    with pytest.raises(ConfigError, match="the 'text' field holds int64, not text"):
        open_dataset("files", str(ints))
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": 5}\n{"text": "a"}\n')
    data, _ = open_dataset("files", str(mixed))
    assert data.features["text"].dtype is None


def test_a_run_reading_the_bundled_corpus_never_imports_datasets():
    """Half a second of every rank's start: the trainer's dataloader built over the bundled
    documents and one batch read, in a fresh interpreter."""
    code = (
        "import sys\n"
        "from torchtitan.components.dataloader import build_dataloader\n"
        "from torchtitan.components.tokenizer import build_tokenizer\n"
        "loader = build_dataloader(dataset='python_docs', dataset_path=None, seq_len=32,\n"
        "    local_batch_size=2, tokenizer=build_tokenizer('tests/assets/tokenizer'),\n"
        "    dp_rank=1, dp_world_size=2)\n"
        "inputs, labels = next(iter(loader))\n"
        "assert labels.shape == (2, 32), labels.shape\n"
        "print(sorted(m for m in ('datasets', 'pyarrow', 'pandas') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"

"""Pre-tokenized data: ``scripts/pretokenize.py`` writes token shards, ``TokenWindows`` reads
them. The windows equal the text loader's on the same documents, ranks and workers split
them, shuffled epochs read every window once, resumes are exact, and every bad folder, state
or flag is refused in one line."""

from __future__ import annotations

import gzip
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from torchtitan.components.dataloader import ParallelAwareDataloader, build_dataloader
from torchtitan.components.token_shards import (
    ShardWriter,
    open_folder,
    tokenizer_fingerprint,
    verify,
)
from torchtitan.components.token_windows import Permutation
from torchtitan.components.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.config.validation import validate, validate_launch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import pretokenize  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SEQ = 255  # windows of 256 tokens


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def corpus_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled corpus pre-tokenized into shards of about 100k tokens (8 shards), so
    windows cross shard boundaries."""
    out = tmp_path_factory.mktemp("tokens") / "python_docs"
    assert pretokenize.main(["--out", str(out), "--shard_tokens", "100000"]) == 0
    return out


@pytest.fixture(scope="module")
def small_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """23 validation documents (37,581 tokens) in 4 shards."""
    out = tmp_path_factory.mktemp("tokens") / "small"
    flags = ["--dataset", "python_docs_validation", "--shard_tokens", "10000"]
    assert pretokenize.main(["--out", str(out), *flags]) == 0
    return out


def _loader(path: Path, tokenizer: Any, **kwargs: Any) -> ParallelAwareDataloader:
    args = dict(seq_len=SEQ, local_batch_size=4, dp_rank=0, dp_world_size=1)
    return build_dataloader(
        dataset="tokens", dataset_path=str(path), tokenizer=tokenizer, **(args | kwargs)
    )


def _rows(batches: Any) -> list[tuple[int, ...]]:
    """Each row of the batches as its window of ``seq_len + 1`` tokens."""
    return [
        tuple(x.tolist() + y[-1:].tolist())
        for inputs, labels in batches
        for x, y in zip(inputs["input"], labels, strict=True)
    ]


def _saved(state: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    torch.save(state, tmp_path / "state.pt")
    return torch.load(tmp_path / "state.pt", weights_only=True)


# --- writing --------------------------------------------------------------------------------


def test_the_windows_are_the_text_loaders_windows(corpus_tokens: Path, tokenizer: Any) -> None:
    """The whole first epoch, bitwise: the shards hold each document framed by bos and eos in
    the data's order, and windows read across the shards' boundaries."""
    folder = open_folder(corpus_tokens)
    assert len(folder.shards) == 8 and folder.documents == 445
    text = build_dataloader(
        dataset="python_docs", dataset_path=None, tokenizer=tokenizer, seq_len=SEQ,
        local_batch_size=4, dp_rank=0, dp_world_size=1,
    )  # fmt: skip
    batches = folder.tokens // (SEQ + 1) // 4
    pairs = itertools.islice(zip(text, _loader(corpus_tokens, tokenizer), strict=True), batches)
    for i, ((x, y), (tx, ty)) in enumerate(pairs):
        assert torch.equal(x["input"], tx["input"]) and torch.equal(y, ty), f"batch {i}"
        assert tx["input"].dtype == torch.long


def test_workers_write_the_same_bytes(corpus_tokens: Path, tmp_path: Path) -> None:
    out = tmp_path / "two_workers"
    assert pretokenize.main(["--out", str(out), "--shard_tokens", "100000", "--workers", "2"]) == 0
    one, two = open_folder(corpus_tokens), open_folder(out)
    assert one.shards == two.shards and one.identity == two.identity
    for a, b in zip(one.arrays(), two.arrays(), strict=True):
        assert numpy.array_equal(a, b)


def test_shards_hold_whole_documents(tmp_path: Path) -> None:
    """A shard ends with the document that brings it to ``shard_tokens``; ids outside the
    vocabulary are refused; the folder appears only when it is complete."""
    writer = ShardWriter(tmp_path / "out", vocab_size=300, shard_tokens=10)
    writer.add(list(range(4)) + list(range(4)) + list(range(5)), [4, 4, 5])  # 13: one shard
    writer.add([7] * 3 + [8] * 20 + [9] * 2, [3, 20, 2])  # 3 + 20 fill one; 2 start the next
    with pytest.raises(ValueError, match="token id 300 outside a vocabulary of 300"):
        writer.add([300], [1])
    assert not (tmp_path / "out").exists()
    folder = writer.close(tokenizer={}, source={})
    assert [(s.tokens, s.documents) for s in folder.shards] == [(13, 3), (23, 2), (2, 1)]
    assert folder.dtype == "uint16" and folder.max_token_id == 9
    assert not (tmp_path / "out.partial").exists()
    assert numpy.concatenate(folder.arrays())[13:16].tolist() == [7, 7, 7]
    assert ShardWriter(tmp_path / "wide", vocab_size=70000, shard_tokens=10).dtype == "uint32"


def test_nothing_is_overwritten(small_tokens: Path, tmp_path: Path, capsys: Any) -> None:
    """An existing folder or another run's ``.partial`` is refused; a run that fails removes
    its own ``.partial`` (the next one starts clean)."""
    before = (small_tokens / "meta.json").read_text()
    assert pretokenize.main(["--out", str(small_tokens)]) == 2
    assert f"{small_tokens} exists; nothing is overwritten" in capsys.readouterr().err
    assert (small_tokens / "meta.json").read_text() == before
    (tmp_path / "run.partial").mkdir()
    assert pretokenize.main(["--out", str(tmp_path / "run")]) == 2
    assert "run.partial exists" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": null}\n')
    flags = ["--out", str(tmp_path / "failed"), "--dataset", "files", "--dataset_path", str(bad)]
    assert pretokenize.main(flags) == 2
    assert "a row has NoneType as 'text', not text" in capsys.readouterr().err
    assert not (tmp_path / "failed.partial").exists() and not (tmp_path / "failed").exists()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--dataset", "files"], "error: --dataset files needs --dataset_path"),
        (["--dataset", "tokens"], "--dataset tokens is pre-tokenized already"),
        (["--dataset", "chat_demo"], "--dataset chat_demo holds chat rows"),
        (["--max_tokens", "0"], "--max_tokens 0 must be positive"),
        (["--tokenizer", "nothing"], "error: --tokenizer=nothing: nothing does not exist"),
    ],
)
def test_the_scripts_refusals_name_its_own_flags(
    flags: list[str], expected: str, tmp_path: Path, capsys: Any
) -> None:
    assert pretokenize.main(["--out", str(tmp_path / "out"), *flags]) == 2
    error = capsys.readouterr().err
    assert expected in error and error.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_verify_finds_a_changed_byte(small_tokens: Path, tmp_path: Path, capsys: Any) -> None:
    assert pretokenize.main(["--verify", str(small_tokens)]) == 0
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in small_tokens.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard = copy / "tokens-00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    assert verify(open_folder(copy)) == [
        f"{shard}: CRC-32 {_crc(shard)}, meta.json says {open_folder(copy).shards[1].crc32:08x}"
    ]
    assert pretokenize.main(["--verify", str(copy)]) == 1
    assert "tokens-00001.bin: CRC-32" in capsys.readouterr().err


def _crc(path: Path) -> str:
    import zlib

    return f"{zlib.crc32(path.read_bytes()):08x}"


def test_max_tokens_stops_at_a_document_boundary(tmp_path: Path, tokenizer: Any) -> None:
    out = tmp_path / "part"
    assert pretokenize.main(["--out", str(out), "--max_tokens", "5000"]) == 0
    folder = open_folder(out)
    tokens = numpy.concatenate(folder.arrays())
    assert folder.tokens >= 5000 and tokens[-1] == tokenizer.eos_id
    starts = numpy.flatnonzero(tokens == tokenizer.bos_id)
    assert len(starts) == folder.documents and starts[-1] < 5000  # the last one reached it


def test_a_stream_is_read_in_order_and_cut_at_max_tokens(tmp_path: Path, tokenizer: Any) -> None:
    """A local C4 copy (streamed, two shards) pre-tokenizes to its documents in order: the
    windows are the streaming text loader's; ``--max_tokens`` takes its first documents."""
    root = tmp_path / "c4"
    (root / "en").mkdir(parents=True)
    texts = [f"document {i}: " + "some words of text " * (40 + i) for i in range(12)]
    for shard, part in enumerate((texts[:7], texts[7:])):
        name = root / "en" / f"c4-train.{shard:05d}-of-00002.json.gz"
        with gzip.open(name, "wt") as f:
            f.writelines(json.dumps({"text": t, "url": "u", "timestamp": "t"}) + "\n" for t in part)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n"
        "    path: en/c4-train.*.json.gz\n---\n"
    )
    out = tmp_path / "c4_tokens"
    assert (
        pretokenize.main(["--out", str(out), "--dataset", "c4", "--dataset_path", str(root)]) == 0
    )
    folder = open_folder(out)
    expected = [t for text in texts for t in tokenizer.encode(text, add_bos=True, add_eos=True)]
    assert numpy.concatenate(folder.arrays()).tolist() == expected
    text = build_dataloader(
        dataset="c4", dataset_path=str(root), tokenizer=tokenizer, seq_len=63,
        local_batch_size=2, dp_rank=0, dp_world_size=1,
    )  # fmt: skip
    windows = folder.tokens // 64 // 2
    assert _rows(itertools.islice(text, windows)) == _rows(
        itertools.islice(_loader(out, tokenizer, seq_len=63, local_batch_size=2), windows)
    )
    part = tmp_path / "c4_part"
    flags = ["--dataset", "c4", "--dataset_path", str(root), "--max_tokens", "300"]
    assert pretokenize.main(["--out", str(part), *flags]) == 0
    lengths = numpy.cumsum([len(tokenizer.encode(t, add_bos=True, add_eos=True)) for t in texts])
    documents = int(numpy.searchsorted(lengths, 300)) + 1  # the first to reach 300 tokens
    assert (
        open_folder(part).documents == documents
        and open_folder(part).tokens == lengths[documents - 1]
    )


# --- reading --------------------------------------------------------------------------------


def _all_windows(path: Path, tokenizer: Any, **kwargs: Any) -> list[tuple[int, ...]]:
    folder = open_folder(path)
    stream = numpy.concatenate(folder.arrays()).tolist()
    size = kwargs.get("seq_len", SEQ) + 1
    return [tuple(stream[i * size : (i + 1) * size]) for i in range(folder.tokens // size)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_read_disjoint_blocks_of_every_window(
    small_tokens: Path, tokenizer: Any, num_workers: int
) -> None:
    """Three ranks read 146 windows of 256 tokens: contiguous blocks of 49, 49 and 48, every
    window once; two workers of a rank read its block between them."""
    every = _all_windows(small_tokens, tokenizer)
    assert len(every) == 146
    seen = []
    for rank, (start, stop) in enumerate([(0, 49), (49, 98), (98, 146)]):
        loader = _loader(
            small_tokens, tokenizer, dp_rank=rank, dp_world_size=3, num_workers=num_workers,
            local_batch_size=1,
        )  # fmt: skip
        rows = _rows(itertools.islice(loader, stop - start))
        assert sorted(rows) == sorted(every[start:stop])
        seen += rows
    assert sorted(seen) == sorted(every)


def test_a_shuffled_epoch_reads_every_window_once_in_a_new_order(
    small_tokens: Path, tokenizer: Any
) -> None:
    every = _all_windows(small_tokens, tokenizer)  # 146, read in batches of 2
    it = iter(_loader(small_tokens, tokenizer, shuffle_seed=3, local_batch_size=2))
    first = _rows(itertools.islice(it, 73))
    second = _rows(itertools.islice(it, 73))
    assert sorted(first) == sorted(every) == sorted(second)
    assert first != every and second != first
    halves = [
        _rows(itertools.islice(_loader(small_tokens, tokenizer, shuffle_seed=3, dp_rank=r,
                                       dp_world_size=2, local_batch_size=1), 73))
        for r in range(2)
    ]  # fmt: skip
    assert halves[0] + halves[1] == first  # each rank a block of the same permutation
    other = _rows(itertools.islice(_loader(small_tokens, tokenizer, shuffle_seed=4), 4))
    assert other != first[:16]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle_seed", [None, 5])
def test_resume_is_exact_across_the_epoch_boundary(
    small_tokens: Path, tokenizer: Any, tmp_path: Path, num_workers: int, shuffle_seed: Any
) -> None:
    def make() -> ParallelAwareDataloader:
        return _loader(
            small_tokens, tokenizer, seq_len=1023, num_workers=num_workers,
            shuffle_seed=shuffle_seed,
        )  # fmt: skip

    loader = make()
    it = iter(loader)
    _rows(itertools.islice(it, 7))  # 7 batches of the 9 of an epoch (36 windows of 1,024)
    saved = _saved(loader.state_dict(), tmp_path)
    want = _rows(itertools.islice(it, 6))  # into the second epoch
    resumed = make()
    resumed.load_state_dict(saved)
    assert _rows(itertools.islice(iter(resumed), 6)) == want


@pytest.mark.parametrize("count", [1, 2, 3, 7, 1000, 4097, 65536])
def test_the_permutation_is_one_of_every_index(count: int) -> None:
    permutation = Permutation(count, key=12345)
    order = [permutation[i] for i in range(count)]
    assert sorted(order) == list(range(count))
    if count > 3:
        assert order != list(range(count))
        assert order != [Permutation(count, key=54321)[i] for i in range(count)]
    block = Permutation(count, 12345, count // 3, count // 2)  # a rank's block of it
    assert [block[i] for i in range(len(block))] == order[count // 3 : count // 2]
    with pytest.raises(IndexError):
        permutation[count]  # outside: a walk from there might never come back below count


def test_a_shuffled_resume_does_not_depend_on_how_the_path_is_written(
    small_tokens: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """The order is keyed by the shards' contents: the folder named another way (a trailing
    slash, ``./``, moved) continues exactly."""
    loader = _loader(small_tokens, tokenizer, shuffle_seed=2)
    it = iter(loader)
    _rows(itertools.islice(it, 3))
    saved = _saved(loader.state_dict(), tmp_path)
    want = _rows(itertools.islice(it, 3))
    moved = tmp_path / "moved"
    _copy(small_tokens, moved)
    for path in (f"{small_tokens}/", moved):
        resumed = _loader(Path(path), tokenizer, shuffle_seed=2)
        resumed.load_state_dict(saved)
        assert _rows(itertools.islice(iter(resumed), 3)) == want


def test_a_shuffled_text_state_saved_under_another_name_is_refused(
    tokenizer: Any, tmp_path: Path
) -> None:
    """Text documents are shuffled by the dataset's name as written: the same file named
    another way would continue in another order, so it is refused in one line."""
    corpus = str(REPO / "tests/assets/corpus/validation.jsonl")
    flags = dict(tokenizer=tokenizer, seq_len=SEQ, local_batch_size=2, dp_rank=0,
                 dp_world_size=1, shuffle_seed=1)  # fmt: skip
    loader = build_dataloader(dataset="files", dataset_path=corpus, **flags)
    next(iter(loader))
    saved = _saved(loader.state_dict(), tmp_path)
    other = build_dataloader(
        dataset="files", dataset_path=corpus.replace("/corpus/", "/corpus/./"), **flags
    )
    with pytest.raises(ConfigError, match=r"this run names it files=.*corpus/\./validation.jsonl"):
        other.load_state_dict(saved)


def test_by_row_ranks_read_the_one_process_batch(small_tokens: Path, tokenizer: Any) -> None:
    one = _rows(itertools.islice(_loader(small_tokens, tokenizer, local_batch_size=4), 3))
    ranks = [
        _rows(itertools.islice(_loader(small_tokens, tokenizer, local_batch_size=2,
                                       dp_rank=r, dp_world_size=2, sharding="by_row"), 3))
        for r in range(2)
    ]  # fmt: skip
    assert [ranks[r][2 * b : 2 * b + 2] for b in range(3) for r in range(2)] == [
        one[4 * b + 2 * r : 4 * b + 2 * r + 2] for b in range(3) for r in range(2)
    ]


def test_a_mix_of_tokens_and_documents(small_tokens: Path, tokenizer: Any, tmp_path: Path) -> None:
    """Each dataset of a mix yields its own stream; the mix resumes exactly."""
    mix = parse_args(
        ["--training.dataset_mix", f"tokens={small_tokens}:1", "python_docs:1"],
        console_outputs=False,
    ).training.mix()

    def make() -> ParallelAwareDataloader:
        return build_dataloader(
            dataset="python_docs", dataset_path=None, tokenizer=tokenizer, seq_len=SEQ,
            local_batch_size=2, dp_rank=0, dp_world_size=1, mix=mix,
        )  # fmt: skip

    loader = make()
    it = iter(loader)
    rows = _rows(itertools.islice(it, 4))
    assert rows[0::2] == _all_windows(small_tokens, tokenizer)[:4]
    saved = _saved(loader.state_dict(), tmp_path)
    want = _rows(itertools.islice(it, 3))
    resumed = make()
    resumed.load_state_dict(saved)
    assert _rows(itertools.islice(iter(resumed), 3)) == want


# --- refusals -------------------------------------------------------------------------------


class OtherTokenizer:
    vocab_size, bos_id, eos_id = 2048, 1, 2

    def __repr__(self) -> str:
        return "OtherTokenizer"

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return [1] * add_bos + [ord(c) % 2000 for c in text] + [2] * add_eos


def test_another_tokenizer_is_refused(small_tokens: Path, tokenizer: Any) -> None:
    hf = build_tokenizer(REPO / "tests/assets/tokenizer_hf")
    assert tokenizer_fingerprint(hf) == tokenizer_fingerprint(tokenizer)  # one tokenizer
    with pytest.raises(ConfigError) as refused:
        _loader(small_tokens, OtherTokenizer())
    assert str(refused.value) == (
        f"--training.dataset_path {small_tokens}: made with the tokenizer tests/assets/tokenizer, "
        f"and --model.tokenizer_path {OtherTokenizer()} is another (2048 tokens, bos 1792, eos "
        "1793 there; 2048, 1, 2 here); pass the tokenizer it was made with, or pre-tokenize "
        "the data again with this one (scripts/pretokenize.py)"
    )


def _copy(folder: Path, to: Path) -> Path:
    to.mkdir()
    for f in folder.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def test_damaged_folders_are_refused(small_tokens: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match="none does not exist, so no pre-tokenized data is there; write"
    ):
        open_folder(tmp_path / "none")
    (tmp_path / "cut.partial").mkdir()
    (tmp_path / "cut").mkdir()
    with pytest.raises(ConfigError, match=r"no meta.json in it.*cut.partial is an unfinished"):
        open_folder(tmp_path / "cut")
    torn = _copy(small_tokens, tmp_path / "torn")
    shard = torn / "tokens-00002.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"tokens-00002.bin holds 22852 bytes, meta.json says"):
        open_folder(torn)
    shard.unlink()
    with pytest.raises(ConfigError, match=r"tokens-00002.bin is missing"):
        open_folder(torn)
    newer = _copy(small_tokens, tmp_path / "newer")
    meta = json.loads((newer / "meta.json").read_text())
    (newer / "meta.json").write_text(json.dumps(meta | {"version": 2}))
    with pytest.raises(ConfigError, match=r"not a pre-tokenized folder's \(version 2; this"):
        open_folder(newer)


def test_too_few_windows_for_the_ranks_or_workers(small_tokens: Path, tokenizer: Any) -> None:
    with pytest.raises(ConfigError, match=r"make 1 windows of --training.seq_len 30000 \+ 1, "
                                          r"fewer than the 2 data-parallel ranks"):  # fmt: skip
        _loader(small_tokens, tokenizer, seq_len=30000, dp_world_size=2)
    loader = _loader(small_tokens, tokenizer, seq_len=30000)
    assert len(_rows(itertools.islice(loader, 1))[0]) == 30001
    with pytest.raises(
        ConfigError, match="has 1 windows for data-parallel rank 0 of 1, fewer than its 2"
    ):
        _loader(small_tokens, tokenizer, seq_len=30000, local_batch_size=1, num_workers=2)


def test_states_that_do_not_carry_over_are_refused(
    small_tokens: Path, corpus_tokens: Path, tokenizer: Any, tmp_path: Path
) -> None:
    def state_of(loader: ParallelAwareDataloader) -> dict[str, Any]:
        next(iter(loader))
        return _saved(loader.state_dict(), tmp_path)

    tokens = state_of(_loader(small_tokens, tokenizer))
    text = state_of(
        build_dataloader(dataset="python_docs", dataset_path=None, tokenizer=tokenizer,
                         seq_len=SEQ, local_batch_size=4, dp_rank=0, dp_world_size=1)
    )  # fmt: skip
    refusals = [
        (_loader(small_tokens, tokenizer), text, "was saved reading documents (--training.data_"),
        (_loader(small_tokens, tokenizer, seq_len=127), tokens,
         "saved with --training.seq_len 255, this run has 127"),
        (_loader(small_tokens, tokenizer, shuffle_seed=1), tokens,
         "was saved without --training.shuffle_seed, this run reads with --training.shuffle_seed 1"),
        (_loader(corpus_tokens, tokenizer), tokens, "other tokens than"),
        (build_dataloader(dataset="python_docs", dataset_path=None, tokenizer=tokenizer,
                          seq_len=SEQ, local_batch_size=4, dp_rank=0, dp_world_size=1),
         tokens, "was saved reading pre-tokenized windows, this run reads documents"),
    ]  # fmt: skip
    for loader, state, expected in refusals:
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(")) as refused:
            loader.load_state_dict(state)
        assert "--checkpoint.exclude_from_loading dataloader" in str(refused.value)
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--training.dataset", "tokens"], "--training.dataset tokens needs --training.dataset_path"),
        (["--training.dataset", "tokens", "--training.dataset_path", "{tmp}/nothing"],
         "--training.dataset_path {tmp}/nothing: {tmp}/nothing does not exist, so no "
         "pre-tokenized data is there"),
        (["--training.dataset", "tokens", "--training.dataset_path", "{small}",
          "--training.seq_len", "40000"],
         "--training.dataset_path {small}: its 37,581 tokens are less than one window of "
         "--training.seq_len 40000 + 1"),
        (["--training.dataset", "tokens", "--training.dataset_path", "{small}",
          "--training.seq_len", "20000", "--training.num_workers", "2"],
         "--training.dataset_path {small}: its 37,581 tokens make 1 windows of "
         "--training.seq_len 20000 + 1, fewer than the 2 readers"),
        (["--validation.enable", "--validation.dataset", "tokens", "--validation.dataset_path",
          "{small}", "--validation.seq_len", "512", "--training.num_workers", "80"],
         "--validation.dataset_path {small}: its 37,581 tokens make 73 windows of "
         "--validation.seq_len 512 + 1, fewer than the 80 readers"),
        (["--training.dataset", "tokens", "--training.dataset_path", "{small}",
          "--training.seq_len", "8192", "--training.data_sharding", "by_row",
          "--training.num_workers", "5"],
         "make 4 windows of --training.seq_len 8192 + 1, fewer than the 5 readers "
         "(--training.num_workers)"),
        (["--training.dataset_mix", "tokens={small}:1", "tokens={small}/:1"],
         "--training.dataset_mix tokens={small}/:1: the same tokens as --training.dataset_mix "
         "tokens={small}:1; a mix names each folder once"),
        (["--training.dataset_mix", "tokens:1"], "tokens:1: tokens needs its path, tokens=PATH"),
        (["--training.dataset_mix", "tokens={tmp}/nothing:1", "python_docs:1"],
         "--training.dataset_mix tokens={tmp}/nothing:1: {tmp}/nothing does not exist"),
        (["--validation.enable", "--validation.dataset", "tokens"],
         "--validation.dataset tokens needs --validation.dataset_path"),
        (["--training.dataset", "tokens", "--training.dataset_path", "{small}",
          "--training.data_format", "chat"],
         "--training.dataset tokens: pre-tokenized windows have no samples or roles"),
        (["--training.dataset", "tokens", "--training.dataset_path", "{small}",
          "--model.tokenizer_path", "{other}"], "made with the tokenizer tests/assets/tokenizer"),
    ],
)  # fmt: skip
def test_the_preflight_refuses_in_one_line(
    flags: list[str], expected: str, small_tokens: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other.model"  # the bundled ranks' first 1,500: another tokenizer
    lines = (REPO / "tests/assets/tokenizer/tokenizer.model").read_text().splitlines()
    other.write_text("\n".join(lines[:1500]) + "\n")
    names = {"tmp": str(tmp_path), "small": str(small_tokens), "other": str(other)}
    with pytest.raises(ConfigError) as refused:
        config = parse_args([f.format(**names) for f in flags], console_outputs=False)
        validate(config)
        validate_launch(config)
    assert expected.format(**names) in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_preflight_counts_the_data_parallel_ranks(
    small_tokens: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 windows of 8,193 tokens: 4 ranks (FSDP 4) read one each; 2 workers each are too
    many, as is a fifth rank."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    flags = ["--training.dataset", "tokens", "--training.dataset_path", str(small_tokens)]
    flags += ["--training.seq_len", "8192"]
    for extra, refused in ([], False), (["--training.num_workers", "2"], True):
        config = parse_args([*flags, *extra], console_outputs=False)
        validate(config)
        if refused:
            with pytest.raises(ConfigError, match="fewer than the 8 readers \\(data-parallel"):
                validate_launch(config)
        else:
            validate_launch(config)
    monkeypatch.setenv("WORLD_SIZE", "5")
    config = parse_args(flags, console_outputs=False)
    validate(config)
    with pytest.raises(ConfigError, match="fewer than the 5 readers"):
        validate_launch(config)


def test_the_preflight_passes_a_sound_folder(small_tokens: Path) -> None:
    config = parse_args(
        ["--training.dataset", "tokens", "--training.dataset_path", str(small_tokens)],
        console_outputs=False,
    )
    validate(config)
    validate_launch(config)

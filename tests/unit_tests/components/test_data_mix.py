"""The order of the training data. ``--training.dataset_mix``: windows of several datasets in
their shares, each dataset's windows exactly its own stream, exact resume, and resumes across
mixes. ``--training.shuffle_seed``: a new permutation of the documents each epoch, each rank a
random part, exact resume."""

import json
from pathlib import Path

import pytest
import torch

from torchtitan.components.data_mix import mix_order
from torchtitan.components.dataloader import build_dataloader
from torchtitan.config.entries import MixEntry
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.validation import validate


class IdTokenizer:
    """``"doc <id>"`` becomes ``[bos, id, id, eos]``: windows of 8 tokens hold two documents."""

    bos_id, eos_id = 1000, 1001

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        doc_id = int(text.split()[1])
        return [self.bos_id] * add_bos + [doc_id, doc_id] + [self.eos_id] * add_eos


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Dataset a: documents 0..23; b: 100..109 (shorter: it re-loops sooner)."""
    made = {}
    for name, ids in (("a", range(24)), ("b", range(100, 110))):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in ids))
        made[name] = path
    return made


def _loader(files, weights=(3, 1), names=("a", "b"), **kwargs):
    mix = [MixEntry("files", str(files[n]), w) for n, w in zip(names, weights, strict=True)]
    args = dict(seq_len=7, local_batch_size=2, dp_rank=0, dp_world_size=1)
    return build_dataloader(
        dataset="unused", dataset_path=None, tokenizer=IdTokenizer(), mix=mix, **(args | kwargs)
    )


def _single(path, **kwargs):
    args = dict(seq_len=7, local_batch_size=1, dp_rank=0, dp_world_size=1)
    return build_dataloader(
        dataset="files", dataset_path=str(path), tokenizer=IdTokenizer(), **(args | kwargs)
    )


def _windows(loader, n_batches, it=None):
    it = it if it is not None else iter(loader)
    rows = []
    for _ in range(n_batches):
        inputs, labels = next(it)
        for x, y in zip(inputs["input"], labels, strict=True):
            rows.append(x.tolist() + y[-1:].tolist())
    return rows


def _source(window) -> str:
    return "b" if any(100 <= t < 1000 for t in window) else "a"


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [0.7, 0.3], [0.9, 0.1], [0.123, 0.877]])
def test_the_order_keeps_shares_within_one_window_for_two_and_three_datasets(weights):
    windows = [0] * len(weights)
    for n in range(1, 1001):
        windows[mix_order(weights, windows)] += 1
        assert all(abs(c - w * n) < 1 for c, w in zip(windows, weights, strict=True)), n


def test_each_dataset_gives_its_own_stream_in_its_share(files):
    rows = _windows(_loader(files), 20)  # 40 windows: 30 of a, 10 of b (b re-loops twice)
    sources = [_source(r) for r in rows]
    assert sources.count("a") == 30 and sources.count("b") == 10
    for name in ("a", "b"):
        alone = _windows(_single(files[name]), sources.count(name))
        assert [r for r, s in zip(rows, sources, strict=True) if s == name] == alone


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_resume_continues_exactly(files, tmp_path, num_workers):
    loader = _loader(files, num_workers=num_workers)
    it = iter(loader)
    _windows(loader, 7, it)  # mid-pass of both datasets, b already re-looped once
    path = tmp_path / "state.pt"
    torch.save(loader.state_dict(), path)
    expected = _windows(loader, 9, it)
    resumed = _loader(files, num_workers=num_workers)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert _windows(resumed, 9) == expected


def test_by_row_global_batches_do_not_depend_on_the_data_parallel_degree(files):
    one = _windows(_loader(files, local_batch_size=4, sharding="by_row"), 5)
    ranks = [
        _windows(
            _loader(files, dp_rank=r, dp_world_size=2, sharding="by_row", local_batch_size=2), 5
        )
        for r in range(2)
    ]
    merged = [row for k in range(5) for r in range(2) for row in ranks[r][2 * k : 2 * k + 2]]
    assert merged == one


def test_another_mix_keeps_the_place_of_the_datasets_both_name(files, tmp_path, caplog):
    loader = _loader(files)
    it = iter(loader)
    rows = _windows(loader, 6, it)
    state = loader.state_dict()
    read_a = sum(_source(r) == "a" for r in rows)
    # a alone now, as a mix of one: it goes on after the windows it gave.
    only_a = _loader(files, weights=(1,), names=("a",))
    only_a.load_state_dict(state)
    assert "b start" not in caplog.text
    alone = _windows(_single(files["a"]), read_a + 6)
    assert _windows(only_a, 3) == alone[read_a:]


def test_one_datasets_state_continues_in_a_mix_that_names_it(files):
    single = _single(files["b"])
    it = iter(single)
    _windows(single, 3, it)
    state = single.state_dict()
    expected = _windows(single, 4, it)
    mixed = _loader(files, weights=(1,), names=("b",))
    mixed.load_state_dict(state)
    assert _windows(mixed, 2) == expected  # batches of 2
    elsewhere = _loader(files, weights=(1,), names=("a",))
    with pytest.raises(ConfigError, match="which --training.dataset_mix does not name"):
        elsewhere.load_state_dict(state)


def test_a_state_from_before_mixes_continues_in_a_mix_of_one(files):
    single = _single(files["a"])
    it = iter(single)
    _windows(single, 3, it)
    state = single.state_dict()
    del state["dp_rank_0"]["dataset_state"]["dataset"]  # as states were written before mixes
    expected = _windows(single, 2, it)
    mixed = _loader(files, weights=(1,), names=("a",), local_batch_size=1)
    mixed.load_state_dict(state)
    assert _windows(mixed, 2) == expected
    with pytest.raises(ConfigError, match="saved reading one dataset alone"):
        _loader(files).load_state_dict(state)


def test_a_bad_entry_is_one_line_naming_it(files, tmp_path):
    def build(*entries):
        mix = [MixEntry.parse(e) for e in entries]
        args = dict(seq_len=7, local_batch_size=2, dp_rank=0, dp_world_size=1)
        return build_dataloader(
            dataset="unused", dataset_path=None, tokenizer=IdTokenizer(), mix=mix, **args
        )

    with pytest.raises(ConfigError, match="^--training.dataset_mix chat_demo:1: chat_demo holds "
                       "chat rows.*drop it from the mix"):  # fmt: skip
        build("python_docs:1", "chat_demo:1")
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ConfigError, match=f"^--training.dataset_mix files={missing}:2: no "):
        build("python_docs:1", f"files={missing}:2")
    notext = tmp_path / "notext.jsonl"
    notext.write_text('{"txt": "x"}\n')
    with pytest.raises(ConfigError, match=f"^--training.dataset_mix files={notext}:1: its rows"):
        build(f"files={notext}:1")


def test_a_mix_state_is_refused_by_a_run_of_one_dataset(files):
    loader = _loader(files)
    _windows(loader, 2)
    with pytest.raises(
        ConfigError, match="saved reading --training.dataset_mix files=.*a.jsonl:0.75"
    ):
        _single(files["a"]).load_state_dict(loader.state_dict())


@pytest.mark.parametrize(
    "flags, message",
    [
        (["python_docs"], "'python_docs' is not NAME:WEIGHT or NAME=PATH:WEIGHT"),
        (["python_docs:x"], "the weight 'x' is not a number"),
        (["python_docs:0"], "the weight must be > 0 and finite"),
        (["files=:1"], "is not NAME:WEIGHT"),
        (["python_docs:1", "python_docs:2"], "names a dataset twice"),
        (["python_docs:1", "files:1"], "files:1: files needs its path, files=PATH:WEIGHT"),
        (["python_docs:1e308", "files=x:1e308"], "weights sum to infinity"),
    ],
)
def test_a_bad_mix_is_refused_before_launch(flags, message):
    config = JobConfig()
    config.training.dataset_mix = flags
    with pytest.raises(ConfigError, match="^--training.dataset_mix ") as error:
        validate(config)
    assert message in str(error.value)


def test_a_path_beside_a_mix_is_refused():
    config = JobConfig()
    config.training.dataset_mix = ["python_docs:1"]
    config.training.dataset_path = "x.jsonl"
    with pytest.raises(ConfigError, match="--training.dataset_path does nothing with"):
        validate(config)


def test_paths_may_hold_colons_and_equals_signs():
    entry = MixEntry.parse("files=data/a=b:c/*.jsonl:2.5")
    assert (entry.name, entry.path, entry.weight) == ("files", "data/a=b:c/*.jsonl", 2.5)
    assert entry.label == "files=data/a=b:c/*.jsonl"


# ---- shuffling ---------------------------------------------------------------------------------


def _docs(rows) -> list[int]:
    """The documents of consecutive windows, in order (each is ``bos id id eos``)."""
    tokens = [t for row in rows for t in row]
    return [t for k, t in enumerate(tokens) if t < 1000 and tokens[k - 1] == IdTokenizer.bos_id]


def test_each_epoch_reads_every_document_once_in_a_new_seeded_order(files):
    rows = _windows(_single(files["a"], shuffle_seed=7), 36)  # 3 epochs of 24 documents
    epochs = [_docs(rows)[24 * e : 24 * (e + 1)] for e in range(3)]
    assert all(sorted(e) == list(range(24)) for e in epochs)
    assert epochs[0] != list(range(24)) and epochs[0] != epochs[1] != epochs[2]
    again = _docs(_windows(_single(files["a"], shuffle_seed=7), 12))
    other = _docs(_windows(_single(files["a"], shuffle_seed=8), 12))
    assert again == epochs[0] and other != epochs[0]


def test_ranks_read_disjoint_random_parts_of_the_whole_data(files):
    parts = [
        _docs(_windows(_single(files["a"], shuffle_seed=7, dp_rank=r, dp_world_size=2), 6))
        for r in range(2)
    ]
    assert sorted(parts[0] + parts[1]) == list(range(24))
    assert sorted(parts[0]) != list(range(12))  # not the first half of the file


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_shuffled_resume_continues_exactly_across_epochs(files, tmp_path, num_workers):
    make = lambda: _single(files["a"], shuffle_seed=7, num_workers=num_workers)  # noqa: E731
    loader = make()
    it = iter(loader)
    _windows(loader, 9, it)  # mid-epoch 0
    path = tmp_path / "state.pt"
    torch.save(loader.state_dict(), path)
    expected = _windows(loader, 10, it)  # into epoch 1
    resumed = make()
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert _windows(resumed, 10) == expected


def test_shuffled_by_row_batches_do_not_depend_on_the_degree(files):
    one = _windows(_single(files["a"], shuffle_seed=7, local_batch_size=4, sharding="by_row"), 4)
    ranks = [
        _windows(
            _single(files["a"], shuffle_seed=7, dp_rank=r, dp_world_size=2, local_batch_size=2,
                    sharding="by_row"),
            4,
        )
        for r in range(2)
    ]  # fmt: skip
    assert [row for k in range(4) for r in range(2) for row in ranks[r][2 * k : 2 * k + 2]] == one


def test_another_seed_or_order_is_refused_on_resume(files):
    loader = _single(files["a"], shuffle_seed=7)
    _windows(loader, 2)
    state = loader.state_dict()
    with pytest.raises(
        ConfigError,
        match="saved with --training.shuffle_seed 7, this run reads with --training.shuffle_seed 8",
    ):
        _single(files["a"], shuffle_seed=8).load_state_dict(state)
    with pytest.raises(
        ConfigError, match="shuffle_seed 7, this run reads without --training.shuffle_seed"
    ):
        _single(files["a"]).load_state_dict(state)


def test_a_stream_is_not_shuffled(files):
    import datasets

    from torchtitan.components.dataloader import TextDataset

    stream = datasets.load_dataset(
        "json", data_files=str(files["a"]), split="train", streaming=True
    )
    with pytest.raises(ConfigError, match="--training.shuffle_seed: dataset s is streamed"):
        TextDataset(stream, name="s", tokenizer=IdTokenizer(), seq_len=7, shuffle_seed=1)


def test_a_negative_shuffle_seed_is_refused_before_launch():
    config = JobConfig()
    config.training.shuffle_seed = -1
    with pytest.raises(ConfigError, match="--training.shuffle_seed=-1 must be >= 0"):
        validate(config)

"""Pipeline layouts: which blocks each stage holds, which stages each rank holds, how a model
is cut, and the one-line refusals of layouts that cannot run (before any rank starts)."""

import pytest
import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed.pipeline_parallel import check_split, cut_model
from torchtitan.distributed.pipeline_split import (
    pipeline_layout,
    split_blocks,
    stage_ids,
    stages_per_rank,
)
from torchtitan.models.llama3.args import Llama3Args
from torchtitan.models.llama3.model import Transformer


def test_even_split_counts_embeddings_and_output_as_one_block_each():
    names = split_blocks(6, 4, first=("tok_embeddings",), last=("norm", "output"))
    assert names == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["layers.5", "norm", "output"],
    ]
    # 6 blocks + 2 = 8 units over 3 stages: each ends nearest its share (8/3, 16/3).
    blocks = [
        sum(n.startswith("layers") for n in s)
        for s in split_blocks(6, 3, first=("e",), last=("o",))
    ]
    assert blocks == [2, 2, 2]


def test_the_split_balances_what_the_first_and_last_modules_cost():
    # Llama 3 8B: a free embedding lookup, an output projection of 2.4 blocks.
    counts = split_blocks(32, 4, first=("e",), last=("o",), first_cost=0.0, last_cost=2.4)
    assert [sum(n.startswith("layers") for n in s) for s in counts] == [9, 8, 9, 6]


def test_layers_per_stage_puts_exactly_that_many_blocks_on_each():
    names = split_blocks(6, 3, layers_per_stage=2, first=("e",), last=("o",))
    assert names == [
        ["e", "layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "layers.5", "o"],
    ]
    with pytest.raises(ConfigError, match="pipeline_parallel_layers_per_stage=4 x 3 stages != 6"):
        split_blocks(6, 3, layers_per_stage=4)


def test_too_many_stages_for_the_layers_is_refused():
    with pytest.raises(ConfigError, match="9 pipeline stages need more than 6 layers"):
        split_blocks(6, 9, first=("e",), last=("o",))
    # 8 stages of 6 blocks: the embeddings and the output get a stage each.
    assert split_blocks(6, 8, first=("e",), last=("o",))[0] == ["e"]


@pytest.mark.parametrize(
    ("schedule", "rank", "expected"),
    [
        ("1F1B", 1, [1]),
        ("Interleaved1F1B", 0, [0, 2]),
        ("Interleaved1F1B", 1, [1, 3]),
        ("ZBVZeroBubble", 0, [0, 3]),  # V: rank 0 holds the first and the last stage
        ("DualPipeV", 1, [1, 2]),
    ],
)
def test_stage_placement(schedule, rank, expected):
    per_rank = stages_per_rank(schedule, n_layers=6, pp=2, layers_per_stage=None)
    assert stage_ids(schedule, rank, 2, per_rank) == expected


def test_layers_per_stage_sets_the_stages_per_rank_of_looped_schedules():
    assert stages_per_rank("Interleaved1F1B", n_layers=12, pp=2, layers_per_stage=2) == 3
    assert stages_per_rank("1F1B", n_layers=12, pp=2, layers_per_stage=2) == 1


def test_a_cut_stage_keeps_the_whole_models_names_and_runs_alone():
    args = Llama3Args(dim=32, n_layers=4, n_heads=4, vocab_size=64, max_seq_len=8)
    model = Transformer(args)
    first = cut_model(model, ["tok_embeddings", "layers.0", "layers.1"])
    last = cut_model(model, ["layers.2", "layers.3", "norm", "output"])
    assert {n.split(".")[0] for n, _ in first.named_parameters()} == {"tok_embeddings", "layers"}
    assert [k for k in last.layers.keys()] == ["2", "3"] and last.tok_embeddings is None
    names = {n for part in (first, last) for n, _ in part.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(last(first(tokens)), model(tokens))


def test_a_split_must_place_every_module_once():
    model = Transformer(Llama3Args(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=8))
    with pytest.raises(ConfigError, match="layers.1 on no stage"):
        check_split(model, [["tok_embeddings", "layers.0"], ["norm", "output"]])
    with pytest.raises(ConfigError, match="no module named layers.7"):
        check_split(
            model, [["tok_embeddings", "layers.0", "layers.7"], ["layers.1", "norm", "output"]]
        )


_PP = "--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_microbatch_size 2"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            f"{_PP} --parallelism.pipeline_parallel_schedule 1f1b",
            "1f1b is not a schedule (did you mean 1F1B?)",
        ),
        (f"{_PP} --training.local_batch_size 3", "local_batch_size=3 is not a multiple of"),
        (
            "--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_microbatch_size 8",
            "1F1B with 2 stages cannot run 1 micro-batches",
        ),
        (
            f"{_PP} --training.local_batch_size 4 --parallelism.pipeline_parallel_schedule DualPipeV",
            "DualPipeV with 4 stages cannot run 2 micro-batches",
        ),
        (
            f"{_PP} --parallelism.pipeline_parallel_schedule Interleaved1F1B --training.local_batch_size 10",
            "cannot run 5 micro-batches (--training.local_batch_size 10 / ",
        ),
        (
            f"{_PP} --parallelism.pipeline_parallel_schedule ZBVZeroBubble "
            "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op",
            "per-op selective activation checkpointing",
        ),
        (
            f"{_PP} --parallelism.pipeline_parallel_schedule DualPipeV --compile.enable",
            "refuses compiled stage modules",
        ),
        (
            f"{_PP} --parallelism.pipeline_parallel_schedule InterleavedZeroBubble "
            "--parallelism.fsdp_reshard_after_forward always",
            "gives wrong gradients",
        ),
        (
            f"{_PP} --comm.mode local_tensor --profiling.enable_profiling",
            "the simulated pipeline ranks are threads",
        ),
        (f"{_PP} --model.flavor 1B", "ties the output to the embeddings"),
        (
            f"{_PP} --parallelism.pipeline_parallel_layers_per_stage 4",
            "layers_per_stage=4 x 2 stages != 6",
        ),
        (
            f"{_PP} --parallelism.module_fqns_per_model_part "
            + ",".join(["tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm", "output"]),
            "lists 1 stages, but 1F1B",
        ),
        (  # the final norm mid-model would train, silently another architecture
            f"{_PP} --parallelism.module_fqns_per_model_part "
            "tok_embeddings,layers.0,layers.1,layers.2,norm layers.3,layers.4,layers.5,output",
            "module_fqns_per_model_part: norm comes where the model has layers.3",
        ),
        (
            f"{_PP} --parallelism.module_fqns_per_model_part "
            "tok_embeddings,layers.0,layers.2 layers.1,layers.3,layers.4,layers.5,norm,output",
            "layers.2 comes where the model has layers.1",
        ),
        (
            f"{_PP} --training.local_batch_size 4 --parallelism.pipeline_parallel_schedule "
            "ZBVZeroBubble --validation.enable",
            "--validation.enable with --parallelism.pipeline_parallel_schedule ZBVZeroBubble: a "
            "rank holds two neighbouring stages",
        ),
    ],
)
def test_impossible_pipeline_layouts_are_refused_in_one_line(monkeypatch, argv, expected):
    monkeypatch.setenv("WORLD_SIZE", "4" if "tensor_parallel" in argv else "2")
    with pytest.raises(ConfigError) as error:
        parse_args(argv.split(), console_outputs=False)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_zero_bubble_schedules_keep_fsdp_parameters_gathered(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = f"{_PP} --training.local_batch_size 4 --parallelism.pipeline_parallel_schedule ZBVZeroBubble"
    config = parse_args(argv.split(), console_outputs=False)
    assert config.parallelism.fsdp_reshard_after_forward == "never"
    config = parse_args(_PP.split(), console_outputs=False)
    assert config.parallelism.fsdp_reshard_after_forward == "default"


_CSV = "--parallelism.pipeline_parallel_schedule_csv"


@pytest.mark.parametrize(
    ("rows", "flags", "expected"),
    [
        (["0F0,0B0"], "", "has 1 rows, one per pipeline rank is needed: 2"),
        (["0F0,0B0", "1F0,1X0"], "", "'1X0' in row 1 is not an action"),
        (["0F0,2F0", "1F0"], "", "every stage 0..N-1 must appear on exactly one rank"),
        (["0F0,0B0", "1F0,1B0"], "", "schedules 1 micro-batches, this run has 4"),
        (["0F0,0B0", "1F0,1B0", ""], "", "line 3 is blank, and every line is a pipeline rank"),
        (
            ["0F0,0F1,0B0", "1F0,1F1,1B0,1B1"],
            "",
            "stage 0 runs micro-batch 1 as 0F1; every stage needs, for each of the 2 "
            "micro-batches 0..1, one F and one B (or one I and one W)",
        ),
        (["0F0,0B0,0W0", "1F0,1B0"], "", "stage 0 runs micro-batch 0 as 0F0 0B0 0W0"),
        (
            ["0F0,0I0,0W0", "1F0,1I0,1W0"],
            "--training.local_batch_size 2 --activation_checkpoint.mode selective "
            "--activation_checkpoint.selective_ac_option op",
            "splits backward into input and weight passes",
        ),
    ],
)
def test_csv_schedules_are_checked_before_launch(tmp_path, monkeypatch, rows, flags, expected):
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "schedule.csv"
    path.write_text("\n".join(rows) + "\n")
    argv = f"{_PP} {_CSV} {path} {flags}".split()
    with pytest.raises(ConfigError) as error:
        parse_args(argv, console_outputs=False)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_missing_csv_schedule_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="nope.csv does not exist"):
        parse_args(f"{_PP} {_CSV} {tmp_path / 'nope.csv'}".split(), console_outputs=False)


def test_a_csv_schedule_places_the_stages_its_rows_name(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    csv = "tests/assets/pipeline/looped_2ranks_4stages_split_backward.csv"
    config = parse_args(
        f"{_PP} {_CSV} {csv} --training.local_batch_size 8".split(), console_outputs=False
    )
    layout = pipeline_layout(config.parallelism, n_layers=6)
    assert layout.stages_by_rank == [[0, 2], [1, 3]] and layout.split_backward
    assert config.parallelism.fsdp_reshard_after_forward == "never"


def test_a_misspelt_module_in_an_explicit_split_is_refused_before_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    parts = ["tok_embeddings,layers.0,layers.1,layers.2", "layers.3,layers.4,layers.5,norm,outptu"]
    with pytest.raises(ConfigError) as error:
        parse_args([*_PP.split(), "--parallelism.module_fqns_per_model_part", *parts])
    assert "no module named outptu (did you mean output?)" in str(error.value)

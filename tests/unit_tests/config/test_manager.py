"""Tests for ``torchtitan.config.manager``: registry -> TOML -> CLI layering, validation, errors,
printing, and the ``python -m torchtitan.config.manager`` entry point."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.config import manager, torchtitan_flags
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import format_config, parse_args, to_toml, validate
from torchtitan.models.llama3 import flavors as llama3_flavors

REPO_ROOT = Path(__file__).resolve().parents[3]
LLAMA3_CONFIGS = [
    "llama3_1b",
    "llama3_3b",
    "llama3_405b",
    "llama3_70b",
    "llama3_8b",
    "llama3_debugmodel",
]


@pytest.fixture(autouse=True)
def _no_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # validate() checks degrees against WORLD_SIZE only when it is set; tests opt in explicitly.
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def parse(*argv: str) -> JobConfig:
    return parse_args(list(argv), console_outputs=False)


def write_toml(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(*argv: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(*argv)
    return str(info.value)


# --- layering: registry < TOML < CLI -------------------------------------------------------


def test_registry_function_is_the_base_layer() -> None:
    config = parse()
    # llama3_debugmodel's values, which differ from the dataclass defaults (10000, 2048, 8e-4).
    assert (config.training.steps, config.training.seq_len) == (100, 512)
    assert config.optimizer.lr == 2e-3
    assert config.job.config_file is None


@pytest.mark.parametrize(
    "form", ["--job.config_file", "--job.config_file=", "--job.config-file", "--job.config-file="]
)
def test_toml_overrides_registry_and_cli_overrides_toml(tmp_path: Path, form: str) -> None:
    path = write_toml(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n")
    flag = [form + str(path)] if form.endswith("=") else [form, str(path)]

    config = parse(*flag)
    assert config.training.steps == 7
    assert config.training.seq_len == 64
    assert config.optimizer.lr == 2e-3  # untouched by the TOML: still the registry's
    assert config.job.config_file == str(path)

    config = parse(*flag, "--training.steps", "9")
    assert config.training.steps == 9
    assert config.training.seq_len == 64  # only in the TOML: keeps the TOML value


def test_cli_wins_over_toml_whatever_the_flag_order(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[training]\nsteps = 7\n")
    assert parse("--training.steps", "9", "--job.config_file", str(path)).training.steps == 9


def test_bad_config_file_path_is_a_config_error(tmp_path: Path) -> None:
    message = config_error("--job.config_file", str(tmp_path / "missing.toml"))
    assert "--job.config_file" in message and "missing.toml" in message


# --- booleans -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag", ["--metrics.no_enable_color_printing", "--metrics.no-enable-color-printing"]
)
def test_negated_bool_flag(flag: str) -> None:
    assert parse().metrics.enable_color_printing is True
    assert parse(flag).metrics.enable_color_printing is False


def test_bool_flag_turns_on() -> None:
    assert parse().metrics.enable_tensorboard is False
    assert parse("--metrics.enable_tensorboard").metrics.enable_tensorboard is True


def test_negated_bool_flag_overrides_registry_true() -> None:
    assert parse("--config", "llama3_8b").metrics.enable_tensorboard is True
    config = parse("--config", "llama3_8b", "--metrics.no_enable_tensorboard")
    assert config.metrics.enable_tensorboard is False


def test_cli_bool_flag_overrides_toml_false(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[metrics]\nenable_color_printing = false\n")
    assert parse("--job.config_file", str(path)).metrics.enable_color_printing is False
    config = parse("--job.config_file", str(path), "--metrics.enable_color_printing")
    assert config.metrics.enable_color_printing is True


# --- lists, Optionals, numeric coercion ------------------------------------------------------


def test_list_flag_takes_several_values() -> None:
    assert parse().checkpoint.exclude_from_loading == []
    config = parse("--checkpoint.exclude_from_loading", "dataloader", "lr_scheduler")
    assert config.checkpoint.exclude_from_loading == ["dataloader", "lr_scheduler"]


def test_optional_int_flag() -> None:
    assert parse().debug.seed is None
    assert parse("--debug.seed", "3").debug.seed == 3


def test_cli_none_overrides_toml_value(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[debug]\nseed = 5\n")
    assert parse("--job.config_file", str(path)).debug.seed == 5
    assert parse("--job.config_file", str(path), "--debug.seed", "None").debug.seed is None


def test_toml_ints_become_floats_for_float_fields(tmp_path: Path) -> None:
    path = write_toml(
        tmp_path,
        "[optimizer]\nlr = 1\n[lr_scheduler]\ndecay_ratio = 1\n"
        "[checkpoint]\nexclude_from_loading = ['optimizer']\n",
    )
    config = parse("--job.config_file", str(path))
    assert type(config.optimizer.lr) is float and config.optimizer.lr == 1.0
    assert type(config.lr_scheduler.decay_ratio) is float and config.lr_scheduler.decay_ratio == 1.0
    assert config.checkpoint.exclude_from_loading == ["optimizer"]


# --- unknown flags and bad TOML ------------------------------------------------------------


@pytest.mark.parametrize("argv", ["--training.stepz 3", "--trainin.steps 3", "--training.stepz=3"])
def test_unknown_cli_flag_names_it_and_suggests(argv: str) -> None:
    flag = argv.split()[0].split("=")[0]
    expected = f"unknown flag {flag} (did you mean --training.steps?)"
    assert expected in config_error(*argv.split())


@pytest.mark.parametrize("flag", ["--no-metrics.report", "--no_metrics.report"])
def test_a_boolean_turned_off_before_its_section_is_shown_the_spelling(flag: str) -> None:
    expected = f"unknown flag {flag} (a flag turns off with no_ after its section: "
    assert expected + "--metrics.no_report)" in config_error(flag)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ("--debug.moe_force_load_balance", "here it is --moe.force_load_balance"),
        ("--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path takes a Hugging Face"),
        ("--debug.no_moe_force_load_balance", "leave it out: off is the default here"),
        ("--no-metrics.disable-color-printing", "leave it out: off is the default here"),
        ("--parallelism.context_parallel_load_balancer headtail", "context_parallel_load_balance,"),
    ],
)
def test_a_torchtitan_flag_is_answered_with_what_to_write_here(argv: str, expected: str) -> None:
    flag = argv.split()[0]
    message = config_error(*argv.split())
    assert message.startswith(f"unknown flag {flag} (torchtitan 0.3.0's flag; "), message
    assert expected in message and "did you mean" not in message


def test_a_torchtitan_field_in_toml_is_answered_too(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[debug]\nprint_config = true\n")
    message = config_error("--job.config_file", str(path))
    assert "unknown field debug.print_config in " in message
    assert "(torchtitan 0.3.0's flag; here: python -m torchtitan.config.manager" in message
    path = write_toml(tmp_path, "[debug]\nmoe_force_load_balance = false\n", name="off.toml")
    message = config_error("--job.config_file", str(path))
    assert "(torchtitan 0.3.0's flag; leave it out: off is the default here)" in message


def test_the_flags_a_torchtitan_answer_names_exist() -> None:
    known = manager._known_flags()
    for name, answer in torchtitan_flags.MIGRATED.items():
        assert f"--{name}" not in known, f"{name} is ours now: drop its entry"
        for flag in re.findall(r"--[a-z_]+\.[a-z_]+", answer):
            assert flag in known, f"{name}'s answer names {flag}, which is not a flag"


def test_unknown_cli_flag_without_close_match_has_no_suggestion() -> None:
    message = config_error("--zzzz.qqqq", "1")
    assert "unknown flag --zzzz.qqqq" in message and "did you mean" not in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[trainin]\nsteps = 1\n", ["unknown section [trainin]", "did you mean training?"]),
        ("[training]\nstepz = 1\n", ["unknown field training.stepz", "training.steps?"]),
        ("[training]\nsteps = 'x'\n", ["training.steps", "'x'", "int"]),
        ("[training]\nsteps = true\n", ["training.steps", "int"]),
        ("[training]\nsteps = 7.5\n", ["training.steps", "int"]),
        ("[metrics]\nenable_color_printing = 'false'\n", ["metrics.enable_color_printing", "bool"]),
        ("[checkpoint]\nexclude_from_loading = 'x'\n", ["checkpoint.exclude_from_loading", "list"]),
        ("[optimizer]\nname = 'SGD'\n", ["optimizer.name", "'SGD'", "'AdamW', 'Adam'"]),
        ("[compile]\ncomponents = ['model', 'x']\n", ["compile.components", "'model', 'loss'"]),
        ("[lr_scheduler]\ndecay_ratio = 'x'\n", ["lr_scheduler.decay_ratio", "float"]),
        ("training = 3\n", ["[training]", "table"]),
        ("[training\nsteps = 1\n", ["not valid TOML"]),
    ],
)
def test_bad_toml_names_the_field_and_the_file(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    path = write_toml(tmp_path, text)
    message = config_error("--job.config_file", str(path))
    for part in [*expected, str(path)]:
        assert part in message


# --- validate: ranges and degrees ----------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--training.steps", "0", "--training.steps=0 must be >= 1"),
        ("--training.local_batch_size", "0", "--training.local_batch_size=0 must be >= 1"),
        ("--optimizer.lr", "-1", "--optimizer.lr=-1.0 must be > 0"),
        ("--optimizer.beta1", "1", "--optimizer.beta1=1.0 must be in [0, 1)"),
        ("--lr_scheduler.warmup_steps", "-1", "--lr_scheduler.warmup_steps=-1 must be >= 0"),
        ("--lr_scheduler.min_lr_factor", "2", "--lr_scheduler.min_lr_factor=2.0 must be in"),
        ("--lr_scheduler.decay_ratio", "1.5", "--lr_scheduler.decay_ratio=1.5 must be in"),
        ("--training.spike_sigma", "-1", "--training.spike_sigma=-1.0 must be >= 0 and finite"),
        ("--training.spike_window", "1", "--training.spike_window=1 must be >= 2"),
        ("--metrics.log_freq", "0", "--metrics.log_freq=0 must be >= 1"),
        ("--parallelism.tensor_parallel_degree", "0", "tensor_parallel_degree=0 must be >= 1"),
        ("--parallelism.data_parallel_replicate_degree", "0", "replicate_degree=0 must be >= 1"),
        ("--parallelism.data_parallel_shard_degree", "-2", "shard_degree=-2 must be -1 (auto)"),
    ],
)
def test_out_of_range_values_name_the_flag(flag: str, value: str, expected: str) -> None:
    message = config_error(flag, value)
    assert message.startswith(f"{flag}=") and expected in message


@pytest.mark.parametrize(
    "argv",
    [
        "--training.steps 1",
        "--lr_scheduler.warmup_steps 0",
        "--lr_scheduler.min_lr_factor 0 --lr_scheduler.decay_ratio 1",
        "--lr_scheduler.min_lr_factor 1 --parallelism.data_parallel_shard_degree -1",
    ],
)
def test_boundary_values_are_accepted(argv: str) -> None:
    parse(*argv.split())


def test_degrees_not_checked_against_world_size_when_unset() -> None:
    config = parse("--parallelism.data_parallel_replicate_degree", "3")
    assert config.parallelism.data_parallel_replicate_degree == 3


def test_degrees_that_do_not_divide_world_size_are_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = config_error("--parallelism.data_parallel_replicate_degree", "3")
    assert "world size 2" in message and "--parallelism." in message


_MISMATCH = [f"--parallelism.data_parallel_{k}_degree=2" for k in ("replicate", "shard")]


def test_degree_product_mismatch_names_the_shard_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = config_error(*_MISMATCH)
    assert "= 4 != world size 2" in message
    assert "--parallelism.data_parallel_shard_degree=-1" in message


def test_degree_product_mismatch_suggests_the_right_ngpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = config_error(*_MISMATCH)
    assert "NGPU=4" in message


def test_valid_degrees_pass_and_auto_shard_is_not_rewritten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = parse("--parallelism.data_parallel_replicate_degree", "2")
    # ParallelDims resolves -1 on its own copy; the config keeps "auto".
    assert config.parallelism.data_parallel_shard_degree == -1
    validate(config)


# --- --config / --module / flavors ---------------------------------------------------------


def test_unknown_config_suggests_closest_and_lists_available() -> None:
    message = config_error("--config", "llama3_8bb")
    assert "--config llama3_8bb" in message
    assert "did you mean llama3_8b?" in message
    assert "available: " + ", ".join(LLAMA3_CONFIGS) in message


@pytest.mark.parametrize("name", ["_pretraining", "JobConfig", "Training"])
def test_private_helpers_and_imports_are_not_configs(name: str) -> None:
    assert f"--config {name} is not in" in config_error("--config", name)


def test_unknown_module_is_a_config_error() -> None:
    message = config_error("--module", "no_such_model_xyz")
    assert "'no_such_model_xyz' not found" in message and "--module" in message


@pytest.mark.parametrize("argv", [["--module"], ["--config"]])
def test_module_and_config_need_a_value(argv: list[str]) -> None:
    assert f"{argv[0]} needs a value" in config_error(*argv)


def test_unknown_flavor_lists_available() -> None:
    message = config_error("--model.flavor", "debugmodle")
    assert "--model.flavor debugmodle" in message
    assert "did you mean debugmodel?" in message
    assert "available: " + ", ".join(llama3_flavors) in message


_TOY_REGISTRY = """\
from pathlib import Path

from torchtitan.config.job_config import JobConfig, Model, Training


def toy_debug() -> JobConfig:
    return JobConfig(
        model=Model(name="ttcfg_models.toy", flavor="tiny"), training=Training(steps=3, seq_len=16)
    )


def toy_with_toml() -> JobConfig:
    config = toy_debug()
    config.job.config_file = str(Path(__file__).with_name("toy.toml"))
    return config


def not_a_config():
    return {"steps": 3}
"""


@pytest.fixture
def toy_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An out-of-tree model package ``ttcfg_models`` on sys.path, removed afterwards."""
    root = tmp_path / "ttcfg_models"
    files = {
        "__init__.py": "",
        "toy/__init__.py": (
            "from torchtitan.models.spec import ModelSpec, lazy\n"
            "from ttcfg_models.toy import config_registry\n\n"
            "model_spec = ModelSpec(name='toy', flavors={'tiny': {'dim': 8}}, "
            "config_registry=config_registry, build_model=lazy('ttcfg_models.toy.model:Toy'), "
            "parallelize=lazy('ttcfg_models.toy.model:parallelize'), "
            "flops_per_token=lazy('ttcfg_models.toy.model:flops'))\n"
        ),
        "toy/config_registry.py": _TOY_REGISTRY,
        "toy/toy.toml": "[training]\nsteps = 11\n",
        "noreg/__init__.py": "flavors = {}\n",
        "broken/__init__.py": "import ttcfg_missing_dependency  # noqa: F401\n",
        # An extension of a sibling model that is not installed.
        "llama_ext/__init__.py": "import ttcfg_models.llama  # noqa: F401\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m.split(".")[0] == "ttcfg_models"]:
        del sys.modules[name]


def test_module_path_loads_out_of_tree_registry(toy_models: Path) -> None:
    config = parse("--module", "ttcfg_models.toy", "--config", "toy_debug")
    assert (config.model.name, config.model.flavor) == ("ttcfg_models.toy", "tiny")
    assert (config.training.steps, config.training.seq_len) == (3, 16)
    assert parse("--module=ttcfg_models.toy", "--config=toy_debug", "--training.steps", "5") == (
        dataclasses.replace(config, training=dataclasses.replace(config.training, steps=5))
    )


def test_module_path_default_config_is_last_component_debugmodel(toy_models: Path) -> None:
    message = config_error("--module", "ttcfg_models.toy")
    assert "--config toy_debugmodel is not in ttcfg_models.toy.config_registry" in message
    assert "available: not_a_config, toy_debug, toy_with_toml" in message


def test_registry_config_file_is_layered_and_cli_replaces_it(
    toy_models: Path, tmp_path: Path
) -> None:
    argv = ["--module", "ttcfg_models.toy", "--config", "toy_with_toml"]
    assert parse(*argv).training.steps == 11
    other = write_toml(tmp_path, "[training]\nsteps = 12\n", name="other.toml")
    assert parse(*argv, "--job.config_file", str(other)).training.steps == 12


def test_out_of_tree_flavor_is_checked(toy_models: Path) -> None:
    message = config_error(
        "--module", "ttcfg_models.toy", "--config", "toy_debug", "--model.flavor", "huge"
    )
    assert "--model.flavor huge is not a ttcfg_models.toy flavor" in message
    assert "available: tiny" in message


def test_registry_function_must_return_job_config(toy_models: Path) -> None:
    message = config_error("--module", "ttcfg_models.toy", "--config", "not_a_config")
    assert "not_a_config() must return a JobConfig" in message


def test_module_without_model_spec(toy_models: Path) -> None:
    assert "has no model_spec" in config_error("--module", "ttcfg_models.noreg")


def test_missing_dependency_inside_a_model_is_not_hidden(toy_models: Path) -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        parse("--module", "ttcfg_models.broken")
    assert info.value.name == "ttcfg_missing_dependency"


def test_missing_sibling_module_with_a_prefix_name_is_not_hidden(toy_models: Path) -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        parse("--module", "ttcfg_models.llama_ext")
    assert info.value.name == "ttcfg_models.llama"


# --- printing ------------------------------------------------------------------------------


def _round_trip(config: JobConfig, tmp_path: Path) -> JobConfig:
    path = write_toml(tmp_path, to_toml(config), name="saved.toml")
    loaded = parse("--job.config_file", str(path))
    # The only intended difference: the reloaded run records which file it came from.
    assert loaded.job.config_file == str(path)
    loaded.job.config_file = config.job.config_file
    return loaded


def test_to_toml_round_trips_through_config_file(tmp_path: Path) -> None:
    config = parse(
        "--training.steps", "3",
        "--optimizer.lr", "1e-4",
        "--lr_scheduler.decay_ratio", "0.25",
        "--checkpoint.exclude_from_loading", "dataloader", "lr_scheduler",
        "--debug.seed", "5",
        "--metrics.no_enable_color_printing",
        "--job.description", 'say "hi" \\ bye\tnow',
    )  # fmt: skip
    assert config.training.dataset_path is None and config.metrics.peak_flops is None
    loaded = _round_trip(config, tmp_path)
    assert loaded == config
    assert loaded.training.dataset_path is None


def test_to_toml_round_trips_none_over_a_non_none_registry_value(tmp_path: Path) -> None:
    config = parse("--job.save_config_file", "None")
    assert config.job.save_config_file is None
    assert _round_trip(config, tmp_path).job.save_config_file is None


def test_to_toml_round_trips_non_bmp_text(tmp_path: Path) -> None:
    config = parse("--job.description", "launch \U0001f680")
    assert _round_trip(config, tmp_path).job.description == "launch \U0001f680"


def test_format_json_has_every_section() -> None:
    config = parse("--training.steps", "3", "--debug.seed", "4")
    data = json.loads(format_config(config, "json"))
    assert list(data) == [f.name for f in dataclasses.fields(JobConfig)]
    assert len(data) == 18
    assert data["training"]["steps"] == 3
    assert data["debug"]["seed"] == 4
    assert data["training"]["dataset_path"] is None


def test_format_text_and_toml() -> None:
    config = parse("--training.steps", "3")
    text = format_config(config, "text")
    assert re.search(r"^training:$", text, re.M)
    assert re.search(r"^  steps\s+3$", text, re.M)
    assert format_config(config, "toml") == to_toml(config)


# --- every named llama3 config -------------------------------------------------------------


@pytest.mark.parametrize("name", LLAMA3_CONFIGS)
def test_every_llama3_config_resolves_and_validates(name: str) -> None:
    config = parse("--module", "llama3", "--config", name)
    assert config.model.name == "llama3"
    assert config.model.flavor in llama3_flavors
    validate(config)


# --- python -m torchtitan.config.manager ---------------------------------------------------

_CLI_RUNS = {
    "json": ["--training.steps", "3", "--job.print_format", "json"],
    "help": ["--help"],
    "bad_value": ["--training.steps", "abc"],
    "unknown_flag": ["--training.stepz", "3"],
    "check": ["--check", "--training.steps", "3"],
}


@pytest.fixture(scope="module")
def cli_runs() -> dict[str, subprocess.CompletedProcess]:
    """Run every CLI case once, concurrently: each launch costs ~0.4 s of interpreter start."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["COLUMNS"] = "200"  # help text wraps at the terminal width
    base = [sys.executable, "-m", "torchtitan.config.manager", "--module", "llama3"]
    base += ["--config", "llama3_debugmodel"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = {
        key: subprocess.Popen(base + argv, cwd=REPO_ROOT, env=env, **pipes)
        for key, argv in _CLI_RUNS.items()
    }
    results = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        results[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def test_cli_prints_json(cli_runs) -> None:
    run = cli_runs["json"]
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["training"]["steps"] == 3
    assert data["model"]["flavor"] == "debugmodel"


def test_cli_help_lists_flags_and_docstrings(cli_runs) -> None:
    run = cli_runs["help"]
    assert run.returncode == 0, run.stderr
    for text in (
        "--training.local_batch_size",
        "--metrics.no_enable_color_printing",
        "--checkpoint.exclude_from_loading",
    ):
        assert text in run.stdout
    # Field docstrings become help, with the registry's value shown as the default.
    assert re.search(r"Tokens per training sequence\.\s*\(default: 512\)", run.stdout)
    # The usage line names what was run (./run_train.sh --help says ./run_train.sh).
    assert run.stdout.startswith("usage: python -m torchtitan.config.manager [-h]"), run.stdout


def test_cli_bad_value_exits_2_naming_the_flag(cli_runs) -> None:
    run = cli_runs["bad_value"]
    assert run.returncode == 2
    assert "--training.steps" in run.stderr
    assert run.stdout == ""


def test_cli_unknown_flag_is_one_line_error(cli_runs) -> None:
    run = cli_runs["unknown_flag"]
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("config error: unknown flag --training.stepz")
    assert "did you mean --training.steps?" in lines[0]


def test_cli_check_is_silent_on_success(cli_runs) -> None:
    run = cli_runs["check"]
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""


# --- COMM_MODE=local_tensor ------------------------------------------------------------------


def test_fsdp_impl_auto_resolves_by_comm_mode() -> None:
    assert parse().parallelism.fsdp_impl == "fsdp2"
    assert parse("--comm.mode", "local_tensor").parallelism.fsdp_impl == "simple"
    assert parse("--parallelism.fsdp_impl", "simple").parallelism.fsdp_impl == "simple"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ("--parallelism.fsdp_impl fsdp2", "--parallelism.fsdp_impl fsdp2 cannot run under"),
        ("--compile.enable", "--compile.enable cannot run under COMM_MODE=local_tensor"),
        ("--checkpoint.create_seed_checkpoint", "create_seed_checkpoint cannot run under"),
        ("--training.enable_cpu_offload", "--training.enable_cpu_offload cannot run under"),
        ("--training.num_workers 1", "--training.num_workers 1 cannot run under"),
        (
            "--checkpoint.enable --checkpoint.initial_load_path x "
            "--checkpoint.no_initial_load_model_only",
            "--checkpoint.no_initial_load_model_only cannot run under COMM_MODE=local_tensor",
        ),
        (
            "--validation.enable --validation.sample_prompt def",
            "--validation.sample_prompt cannot run under COMM_MODE=local_tensor",
        ),
        (
            "--training.dtype bfloat16 --optimizer.stochastic_rounding",
            "--optimizer.stochastic_rounding cannot run under COMM_MODE=local_tensor",
        ),
    ],
)
def test_what_local_tensor_cannot_simulate_is_refused(argv: str, expected: str) -> None:
    message = config_error("--comm.mode", "local_tensor", *argv.split())
    assert expected in message and "\n" not in message


def test_stochastic_rounding_needs_bf16_parameters() -> None:
    message = config_error("--optimizer.stochastic_rounding")
    assert message == (
        "--optimizer.stochastic_rounding rounds bf16 parameters, and this run's are float32; "
        "pass --training.dtype bfloat16 or drop it"
    )
    parse("--optimizer.stochastic_rounding", "--training.dtype", "bfloat16")


def test_cpu_offload_needs_fsdp2() -> None:
    message = config_error("--parallelism.fsdp_impl", "simple", "--training.enable_cpu_offload")
    assert "--training.enable_cpu_offload needs --parallelism.fsdp_impl fsdp2" in message


def test_simple_fsdp_cannot_reshard_after_forward() -> None:
    message = config_error(
        "--comm.mode", "local_tensor", "--parallelism.fsdp_reshard_after_forward", "always"
    )
    assert "--parallelism.fsdp_reshard_after_forward always needs" in message
    parse("--parallelism.fsdp_reshard_after_forward", "always")  # auto -> fsdp2 outside


@pytest.mark.parametrize(
    "argv",
    ["--checkpoint.initial_load_path seed", "--checkpoint.load_step 5", "--checkpoint.load_only"],
)
def test_loading_flags_without_checkpointing_are_an_error(argv: str) -> None:
    flag = argv.split()[0]
    assert config_error(*argv.split()) == (
        f"{flag} does nothing without --checkpoint.enable; add it"
    )
    parse("--checkpoint.enable", *argv.split())


def test_async_tensor_parallel_needs_compiled_tensor_parallel_blocks() -> None:
    tp = ("--parallelism.tensor_parallel_degree", "2")
    asynchronous = "--parallelism.enable_async_tensor_parallel"
    message = config_error(*tp, asynchronous)
    assert message.startswith(f"{asynchronous} needs --parallelism.tensor_parallel_degree > 1")
    assert config_error(*tp, asynchronous, "--compile.enable", "--compile.components", "loss")
    parse(*tp, asynchronous, "--compile.enable")
    parse(*tp, "--compile.enable")  # compiled TP blocks: test_parallel_numerics.py


@pytest.mark.parametrize(
    "checkpointing",
    ["--activation_checkpoint.mode full", "--activation_checkpoint.mode selective"],
)
def test_whole_block_checkpointing_of_compiled_tensor_parallel_blocks_is_refused(
    checkpointing: str,
) -> None:
    argv = [*checkpointing.split(), "--compile.enable", "--parallelism.tensor_parallel_degree"]
    message = config_error(*argv, "2")
    assert message.startswith(f"{checkpointing}")  # with its block interval when selective
    assert (
        "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
        in message
    )
    assert "\n" not in message
    parse(*argv, "1")
    per_op = ["--activation_checkpoint.mode", "selective"]
    parse(*per_op, "--activation_checkpoint.selective_ac_option", "op", *argv[2:], "2")


# --- rules the pre-flight runs before any rank starts --------------------------------------


@pytest.mark.parametrize(
    ("world", "argv", "expected"),
    [
        (
            None,
            "--float8.enable --float8.recipe_name rowwise --float8.enable_fsdp_float8_all_gather",
            "torchao gathers float8 weights for tensorwise scaling only",
        ),
        (
            None,
            "--parallelism.fsdp_prefetch -1",
            "--parallelism.fsdp_prefetch=-1 must be >= 0",
        ),
        (
            None,
            "--parallelism.fsdp_prefetch 1 --parallelism.fsdp_impl simple",
            "--parallelism.fsdp_prefetch needs --parallelism.fsdp_impl fsdp2",
        ),
        (
            None,
            "--float8.enable --float8.enable_fsdp_float8_all_gather --parallelism.fsdp_impl simple",
            "--float8.enable_fsdp_float8_all_gather needs --parallelism.fsdp_impl fsdp2",
        ),
        (None, "--training.loss_chunks 0", "--training.loss_chunks=0 must be >= 1"),
        (
            None,
            "--validation.enable --training.seq_len 64 --validation.seq_len 128",
            "--validation.seq_len=128 must be in [1, --training.seq_len=64]",
        ),
        (
            "4",
            "--validation.enable --parallelism.pipeline_parallel_degree 2 "
            "--validation.local_batch_size 2",
            "--validation.local_batch_size=2 and --validation.seq_len=512 must equal the "
            "training's (8, 512) under pipeline parallelism",
        ),
        (
            "2",
            "--validation.enable --parallelism.context_parallel_degree 2 --training.seq_len 64 "
            "--validation.seq_len 42",
            "--validation.seq_len=42 must split over context parallelism (4 chunks)",
        ),
        (None, "--validation.enable --validation.freq 0", "--validation.freq=0 must be >= 1"),
        (
            None,
            "--checkpoint.last_save_in_hf",
            "--checkpoint.last_save_in_hf does nothing without --checkpoint.enable",
        ),
        (
            "2",
            "--parallelism.context_parallel_degree 2 --training.seq_len 102",
            "--parallelism.context_parallel_degree=2: --training.seq_len=102 must split into 2 x "
            "cp = 4 chunks",
        ),
        (
            "2",
            "--parallelism.context_parallel_degree 2 --training.seq_len 101 "
            "--parallelism.no_context_parallel_load_balance",
            "--training.seq_len=101 must split into 2 pieces",
        ),
        (
            "4",
            "--parallelism.context_parallel_degree 2 --parallelism.tensor_parallel_degree 2 "
            "--training.seq_len 6 --parallelism.no_context_parallel_load_balance",
            "does not divide --training.seq_len=6 / context_parallel_degree 2",
        ),
        (
            "2",
            "--parallelism.context_parallel_degree 2 --model.attn_mask block_causal "
            "--parallelism.context_parallel_rotate_method alltoall",
            "--parallelism.context_parallel_rotate_method=alltoall with --model.attn_mask "
            "block_causal: block-causal attention under context parallelism gathers every "
            "rank's keys and values at once; pass --parallelism.context_parallel_rotate_method "
            "allgather",
        ),
        (
            None,
            "--compile.components model lossy --training.steps 2",
            "--compile.components=lossy is not a choice: use one of model, loss (did you mean "
            "loss?)",
        ),
        (
            None,
            "--parallelism.context_parallel_rotate_method ring",
            "--parallelism.context_parallel_rotate_method=ring is not a choice: use one of "
            "allgather, alltoall",
        ),
        (
            "2",
            "--training.local_batch_size 4 --training.global_batch_size 12",
            "--training.global_batch_size=12 must be a multiple of --training.local_batch_size x "
            "data-parallel degree = 4 x 2 = 8",
        ),
        (
            "2",
            "--training.local_batch_size 4 --training.global_batch_size 24 "
            "--training.global_batch_size_start 4 --training.global_batch_size_ramp_sequences 50",
            "--training.global_batch_size_start=4 must be a multiple of "
            "--training.local_batch_size x data-parallel degree = 4 x 2 = 8, so that each step's "
            "batch splits into whole accumulation batches on every rank",
        ),
        (
            "2",
            "--training.local_batch_size 4 --training.global_batch_size 32 "
            "--training.global_batch_size_start 8 --training.global_batch_size_increment 16 "
            "--training.global_batch_size_ramp_sequences 50",
            "--training.global_batch_size_increment=16 must divide --training.global_batch_size "
            "- global_batch_size_start = 32 - 8",
        ),
        (
            "2",
            "--training.local_batch_size 4 --training.global_batch_size_start 16 "
            "--training.global_batch_size_ramp_sequences 50",
            "--training.global_batch_size_start=16 must be at most the batch it ramps up to, "
            "--training.global_batch_size (-1: local_batch_size x data-parallel degree = 8)",
        ),
        (
            None,
            "--training.global_batch_size 24 --training.global_batch_size_start 32 "
            "--training.global_batch_size_ramp_sequences 50",
            "--training.global_batch_size_start=32 must be at most "
            "--training.global_batch_size=24, the batch it ramps up to",
        ),
        (
            None,
            "--training.global_batch_size 24 --training.global_batch_size_start 8",
            "--training.global_batch_size_start=8 needs "
            "--training.global_batch_size_ramp_sequences >= 1, the sequences trained while the "
            "batch grows",
        ),
        (
            None,
            "--training.global_batch_size_ramp_sequences 100",
            "--training.global_batch_size_ramp_sequences=100 needs "
            "--training.global_batch_size_start (the batch at step 1)",
        ),
        (
            None,
            "--training.global_batch_size_increment 8",
            "--training.global_batch_size_increment=8 needs --training.global_batch_size_start",
        ),
        (
            None,
            "--checkpoint.enable --checkpoint.interval 5 --checkpoint.keep_every 12",
            "--checkpoint.keep_every=12 must be a multiple of --checkpoint.interval=5, or no "
            "checkpoint is saved at the steps it keeps",
        ),
        (
            None,
            "--training.skip_steps 1200-1300 1500-1450",
            "--training.skip_steps entry '1500-1450' must be steps from 1 on, first <= last",
        ),
        (
            None,
            "--training.skip_steps 1200..1300",
            "--training.skip_steps entry '1200..1300' is not a step N or a range FIRST-LAST",
        ),
        (
            None,
            "--training.global_batch_size_start 0 --training.global_batch_size_ramp_sequences 5",
            "--training.global_batch_size_start=0 must be -1 (no ramp) or >= 1",
        ),
        (
            None,
            "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 0",
            "--activation_checkpoint.selective_ac_option='0' must be 'op' or a positive integer",
        ),
        (
            None,
            "--activation_checkpoint.mode memory_budget",
            "--activation_checkpoint.mode memory_budget lets torch.compile's partitioner choose "
            "what to recompute: add --compile.enable",
        ),
        (
            None,
            "--compile.enable --compile.components loss --activation_checkpoint.mode memory_budget",
            "add --compile.enable (with model in --compile.components)",
        ),
        (
            None,
            "--compile.enable --compile.backend eager --activation_checkpoint.mode memory_budget",
            "--activation_checkpoint.mode memory_budget with --compile.backend eager: that "
            "backend splits forward and backward without the budget (or not at all); use "
            "inductor, aot_eager, aot_eager_decomp_partition",
        ),
        (
            None,
            "--compile.enable --activation_checkpoint.mode memory_budget "
            "--activation_checkpoint.memory_budget 1.5",
            "--activation_checkpoint.memory_budget=1.5 must be between 0 (recompute the most) "
            "and 1",
        ),
        (
            "2",
            "--parallelism.tensor_parallel_degree 2 --parallelism.enable_async_tensor_parallel",
            "--parallelism.enable_async_tensor_parallel needs",
        ),
        (None, "--lora.rank -1", "--lora.rank=-1 must be >= 0 (0 turns LoRA off)"),
        (None, "--lora.rank 8 --lora.alpha 0", "--lora.alpha=0.0 must be > 0"),
        (
            None,
            "--lora.target_modules wq",
            "--lora.target_modules does nothing without --lora.rank; add e.g. --lora.rank 8",
        ),
        (None, "--training.steps abc", "--training.steps=abc is not an integer"),
        (None, "--training.steps=1.5", "--training.steps=1.5 is not an integer"),
        (None, "--optimizer.lr fast", "--optimizer.lr=fast is not a number"),
        (
            None,
            "--training.global_batch_size x",
            "--training.global_batch_size=x is not an integer",
        ),
        (
            None,
            "--lora.alpha 32",
            "--lora.alpha 32.0 does nothing without --lora.rank (without it every weight trains)",
        ),
        (
            None,
            "--optimizer.name adamw",
            "--optimizer.name=adamw is not a choice: use one of AdamW, Adam, Muon (did you mean "
            "AdamW?)",
        ),
        (
            None,
            "--lora.rank 8 --lora.save_adapters_only --checkpoint.enable",
            "--lora.save_adapters_only needs --lora.rank, --checkpoint.enable and "
            "--checkpoint.initial_load_path",
        ),
        (
            "4",
            "--model.flavor 8B_4layers --parallelism.pipeline_parallel_degree 4 --lora.rank 8 "
            "--training.local_batch_size 4",
            "--lora.rank with its default targets (the blocks' layers): the pipeline stage of "
            "norm, output holds no block",
        ),
        (
            None,
            "--lora.rank 8 --lora.target_modules wq,.wo",
            "--lora.target_modules wq,.wo: each entry is a module name or a dotted name suffix",
        ),
    ],
)
def test_pre_flight_refuses_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, world: str | None, argv: str, expected: str
) -> None:
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    message = config_error(*argv.split())
    assert expected in message and "\n" not in message


def test_pre_flight_imports_no_torch() -> None:
    code = (
        "import sys; from torchtitan.config.manager import parse_args; "
        "parse_args(['--training.global_batch_size', '16']); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "RANK"} | {"WORLD_SIZE": "2"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], "--validation.only runs one validation: add --validation.enable"),
        (
            ["--validation.enable", "--checkpoint.create_seed_checkpoint"],
            "--validation.only and --checkpoint.create_seed_checkpoint are two different runs",
        ),
    ],
)
def test_validation_only_is_refused_without_a_validation_or_with_another_run(flags, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate(parse("--validation.only", *flags))


def test_settings_of_a_feature_that_is_off_are_named_as_ignored() -> None:
    from torchtitan.config.validation import ignored_settings

    config = parse(
        "--checkpoint.interval", "5", "--float8.recipe_name", "rowwise", "--validation.freq", "3",
        "--activation_checkpoint.selective_ac_option", "op", "--lr_scheduler.warmup_steps", "20",
        "--training.steps", "10", "--training.spike_window", "64",
        "--activation_checkpoint.memory_budget", "0.2",
    )  # fmt: skip
    assert ignored_settings(config) == [
        "--checkpoint.interval 5 is ignored without --checkpoint.enable",
        "--float8.recipe_name rowwise is ignored without --float8.enable",
        "--training.spike_window 64 is ignored without --training.spike_sigma",
        "--validation.freq 3 is ignored without --validation.enable",
        "--activation_checkpoint.selective_ac_option op is ignored without "
        "--activation_checkpoint.mode selective",
        "--activation_checkpoint.memory_budget 0.2 is ignored without "
        "--activation_checkpoint.mode memory_budget",
        "--lr_scheduler.warmup_steps 20 lasts the whole run (--training.steps 10): the LR "
        "never reaches --optimizer.lr 0.002",
    ]
    ramp = parse(
        "--training.global_batch_size", "32", "--training.global_batch_size_start", "8",
        "--training.global_batch_size_ramp_sequences", "100", "--training.steps", "9",
    )  # fmt: skip
    skip = parse("--training.skip_steps", "5-6", "12", "20-30", "--training.steps", "10")
    spikes = parse("--training.spike_sigma", "6", "--training.steps", "128")
    assert ignored_settings(spikes)[-1] == (
        "--training.spike_sigma 6 judges no step: the first comes after --training.spike_window "
        "128 steps, and --training.steps is 128"
    )
    longer = parse("--training.spike_sigma", "6", "--training.steps", "129")
    assert not any("spike" in note for note in ignored_settings(longer))
    assert ignored_settings(skip)[-1] == (
        "--training.skip_steps 12 20-30: past the run's last step (--training.steps 10)"
    )
    assert ignored_settings(ramp)[-1] == (  # 8 x 5 steps, 16 x 2, 24 x 2, then 32 from step 10
        "--training.global_batch_size_ramp_sequences 100 lasts past the run: the batch reaches "
        "--training.global_batch_size at step 10, and --training.steps is 9"
    )
    # Step 10 of a 10-step warm-up trains at 10/11 of the peak; of a 9-step one, at the peak.
    for warmup, noted in (("10", True), ("9", False)):
        run = parse("--lr_scheduler.warmup_steps", warmup, "--training.steps", "10")
        assert any("lasts the whole run" in note for note in ignored_settings(run)) == noted
    # Counted in tokens, the 9 steps hold 120 sequences: 3.75 full batches.
    in_tokens = dataclasses.replace(ramp.lr_scheduler, warmup_steps=4, unit="tokens")
    assert ignored_settings(dataclasses.replace(ramp, lr_scheduler=in_tokens), ramp)[0] == (
        "--lr_scheduler.warmup_steps 4 lasts the whole run (--training.steps 9, the tokens of "
        "3.75 full batches): the LR never reaches --optimizer.lr 0.002"
    )
    in_steps = dataclasses.replace(in_tokens, unit="steps")
    assert len(ignored_settings(dataclasses.replace(ramp, lr_scheduler=in_steps), ramp)) == 1
    on = parse(
        "--checkpoint.enable", "--checkpoint.interval", "5", "--validation.enable",
        "--validation.freq", "3", "--training.steps", "20",
    )  # fmt: skip
    assert ignored_settings(on) == []
    assert ignored_settings(parse("--module", "llama3", "--config", "llama3_8b")) == []


def test_what_the_named_config_sets_for_a_feature_it_leaves_off_is_not_reported() -> None:
    from torchtitan.config.manager import named_config
    from torchtitan.config.validation import ignored_settings

    # llama3_debugmodel sets an interval for when checkpointing is turned on.
    plain = named_config(["--training.steps", "20"])
    assert plain.checkpoint.interval != JobConfig().checkpoint.interval
    assert not plain.checkpoint.enable
    assert ignored_settings(parse("--training.steps", "20"), plain) == []
    argv = ["--training.steps", "20", "--checkpoint.interval", "5"]
    assert ignored_settings(parse(*argv), named_config(argv)) == [
        "--checkpoint.interval 5 is ignored without --checkpoint.enable"
    ]


# --- ./run_train.sh picks the named config ---------------------------------------------------


@pytest.mark.parametrize(
    ("env", "argv", "module"),
    [({"MODULE": "deepseek_v3"}, [], "deepseek_v3"), ({}, ["--module", "qwen3"], "qwen3")],
)
def test_run_train_sh_takes_the_modules_debug_config_without_a_config(env, argv, module) -> None:
    """``MODULE=x`` or ``--module x`` alone means ``x_debugmodel`` (it used to pass
    ``llama3_debugmodel`` along and be refused); ``--help`` shows that config's values."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MODULE", "CONFIG", "RANK")}
    run = subprocess.run(
        ["./run_train.sh", *argv, "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
        env=clean | env | {"COLUMNS": "80", "PYTHON": sys.executable}, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: ./run_train.sh [-h]"), run.stdout[:200]
    assert re.search(rf"--model.name STR\s.*?\(default: {module}\)", run.stdout, re.S)


def test_a_missing_file_of_the_files_dataset_is_refused_before_launch(tmp_path, monkeypatch):
    """``files`` reads only local files: a bare relative name where nothing is, refused by the
    pre-flight; another dataset's path may be a hub id (``c4``'s ``allenai/c4``) and is not."""
    from torchtitan.config.validation import validate_launch

    monkeypatch.chdir(tmp_path)
    files = ["--training.dataset", "files", "--training.dataset_path", "my_pairs.jsonl"]
    with pytest.raises(ConfigError, match=r"my_pairs.jsonl: nothing there \(looked in "):
        validate_launch(parse(*files))
    (tmp_path / "my_pairs.jsonl").write_text('{"text": "a"}\n')
    validate_launch(parse(*files))
    validate_launch(parse("--training.dataset", "c4", "--training.dataset_path", "allenai/c4"))


def test_folders_the_run_cannot_write_are_refused_before_it_trains(tmp_path, monkeypatch):
    """At launch and on each node's first rank: a folder that cannot be made (in /proc: for
    root too, and whatever the reason said) is refused naming its flag, not found at the first save after the training.
    Other ranks of a node leave it to the first; a dry run, a validation of saved weights and
    ``load_only`` write no checkpoint."""
    from torchtitan.config import folders
    from torchtitan.config.validation import validate_environment, validate_launch

    dump = ["--job.dump_folder", str(tmp_path / "dump")]
    ckpt = ["--checkpoint.enable", "--checkpoint.folder", "/proc/titan-test-ckpt"]
    refused = r"^--checkpoint.folder: cannot write in /proc/titan-test-ckpt \(.+\); choose"
    with pytest.raises(ConfigError, match=refused):
        validate_launch(parse(*dump, *ckpt))
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match=refused):
        validate_environment(parse(*dump, *ckpt), "cpu")
    with pytest.raises(ConfigError, match=r"^--job.dump_folder: cannot write in /proc/titan-x"):
        validate_environment(parse("--job.dump_folder", "/proc/titan-x"), "cpu")
    for flags in (
        ["--checkpoint.load_only"],
        ["--validation.only", "--validation.enable"],
        ["--comm.mode", "local_tensor"],
    ):
        assert folders.output_folders(parse(*dump, *ckpt, *flags)) == [
            ("--job.dump_folder", tmp_path / "dump")
        ]
    validate_environment(parse(*dump, *ckpt, "--comm.mode", "fake_backend"), "cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    validate_environment(parse(*dump, *ckpt), "cpu")
    monkeypatch.setenv("LOCAL_RANK", "0")
    validate_environment(parse(*dump, "--checkpoint.enable"), "cpu")  # writable: made, no probe
    assert [p.name for p in (tmp_path / "dump").rglob("*")] == ["checkpoint"]

"""Resolve a trainer config from its layers, lowest first:

1. a named function from a model's ``config_registry`` (``--module llama3 --config llama3_8b``),
2. an optional TOML file (``--job.config_file run.toml``),
3. CLI overrides parsed by tyro (``--section.field value``, ``--section.no_flag``),

then one validation pass. Run ``python -m torchtitan.config.manager --module llama3
--config llama3_debugmodel [overrides]`` to print the result, ``--help`` for every flag.
Nothing here imports torch: resolving and validating a config takes well under a second.
"""

import dataclasses
import difflib
import json
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import tomli
import tyro

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import import_model_module

DEFAULT_MODULE = "llama3"
DEFAULT_CONFIG = "llama3_debugmodel"

_DESCRIPTION = (
    "torchtitan trainer config. Pick a named config with --module NAME (a model under "
    "torchtitan.models or an importable module path; default llama3) and --config NAME (a "
    "function of that module's config_registry; default llama3_debugmodel), layer a TOML file "
    "with --job.config_file, then override any field below."
)


@dataclasses.dataclass(frozen=True)
class _Selection:
    module: str
    config: str
    check_only: bool
    rest: list[str]


def parse_args(
    argv: Sequence[str] | None = None, *, console_outputs: bool | None = None
) -> JobConfig:
    """Build the validated ``JobConfig`` from registry -> TOML -> CLI.

    Raises ``ConfigError`` for problems found by this module; tyro's own parse errors (bad
    value for a known flag) print their message and exit with status 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if console_outputs is None:
        console_outputs = os.environ.get("RANK", "0") == "0"
    selection = _select(argv)
    config = load_registry_config(selection.module, selection.config)

    toml_path = _find_flag_value(selection.rest, "--job.config_file")
    if toml_path is None:
        toml_path = config.job.config_file
    if toml_path is not None:
        apply_toml(config, toml_path)

    check_cli_flags(selection.rest)
    config = tyro.cli(
        JobConfig,
        args=selection.rest,
        default=config,
        use_underscores=True,
        console_outputs=console_outputs,
        prog="python -m torchtitan.train",
        description=_DESCRIPTION,
    )
    validate(config)
    resolve_auto(config)
    return config


def resolve_auto(config: JobConfig) -> None:
    """Replace ``auto`` choices by what they mean for this run, so the resolved config (printed
    and saved) says what actually ran."""
    config.parallelism.fsdp_impl = _fsdp_impl(config)


def _fsdp_impl(config: JobConfig) -> str:
    impl = config.parallelism.fsdp_impl
    if impl != "auto":
        return impl
    return "simple" if config.comm.mode == "local_tensor" else "fsdp2"


def load_registry_config(module_name: str, config_name: str) -> JobConfig:
    """Call ``<module>.config_registry.<config_name>()``."""
    module = import_model_module(module_name)
    registry = getattr(module, "config_registry", None)
    if registry is None:
        raise ConfigError(
            f"--module {module_name} has no config_registry; add a config_registry.py with "
            "functions returning JobConfig"
        )
    names = sorted(n for n, f in vars(registry).items() if _is_registry_function(f, registry))
    fn = getattr(registry, config_name, None)
    if fn is None or config_name not in names:
        raise ConfigError(
            f"--config {config_name} is not in {registry.__name__}"
            f"{_did_you_mean(config_name, names)}; available: {', '.join(names)}"
        )
    config = fn()
    if not isinstance(config, JobConfig):
        raise ConfigError(f"{registry.__name__}.{config_name}() must return a JobConfig")
    return config


def apply_toml(config: JobConfig, path: str | os.PathLike) -> None:
    """Overwrite fields of ``config`` with the values of a TOML file, checking every key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--job.config_file {path} does not exist; pass an existing TOML file")
    try:
        with path.open("rb") as f:
            data = tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"--job.config_file {path} is not valid TOML: {e}") from None
    sections = {f.name: f for f in dataclasses.fields(config)}
    for section_name, values in data.items():
        if section_name not in sections:
            raise ConfigError(
                f"unknown section [{section_name}] in {path}{_did_you_mean(section_name, sections)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"[{section_name}] in {path} must be a table of fields")
        section = getattr(config, section_name)
        hints = typing.get_type_hints(type(section))
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(
                    f"unknown field {section_name}.{key} in {path}"
                    f"{_did_you_mean(key, hints, prefix=section_name + '.')}"
                )
            where = f"{section_name}.{key} in {path}"
            setattr(section, key, _coerce(value, hints[key], where))


def check_cli_flags(args: Sequence[str]) -> None:
    """Reject unknown ``--section.field`` flags with a one-line did-you-mean error."""
    known = _known_flags()
    for arg in args:
        if not arg.startswith("--") or arg in ("--help",):
            continue
        flag = arg.split("=", 1)[0]
        normalized = "--" + flag[2:].replace("-", "_")
        if normalized not in known:
            canonical = sorted(k for k in known if ".no_" not in k)
            hint = _did_you_mean(normalized, canonical)
            raise ConfigError(f"unknown flag {flag}{hint}; see --help for all flags")


def validate(config: JobConfig) -> None:
    """Check value ranges and cross-field rules; raise ``ConfigError`` naming the flag."""
    t, o, s = config.training, config.optimizer, config.lr_scheduler
    checks = [
        (t.steps >= 1, f"--training.steps={t.steps} must be >= 1"),
        (t.local_batch_size >= 1, f"--training.local_batch_size={t.local_batch_size} must be >= 1"),
        (
            t.global_batch_size == -1 or t.global_batch_size >= 1,
            f"--training.global_batch_size={t.global_batch_size} must be -1 (auto) or >= 1",
        ),
        (t.seq_len >= 1, f"--training.seq_len={t.seq_len} must be >= 1"),
        (t.gc_freq >= 0, f"--training.gc_freq={t.gc_freq} must be >= 0"),
        (t.num_workers >= 0, f"--training.num_workers={t.num_workers} must be >= 0"),
        (o.lr > 0, f"--optimizer.lr={o.lr} must be > 0"),
        (0 <= o.beta1 < 1, f"--optimizer.beta1={o.beta1} must be in [0, 1)"),
        (0 <= o.beta2 < 1, f"--optimizer.beta2={o.beta2} must be in [0, 1)"),
        (o.eps > 0, f"--optimizer.eps={o.eps} must be > 0"),
        (o.weight_decay >= 0, f"--optimizer.weight_decay={o.weight_decay} must be >= 0"),
        (s.warmup_steps >= 0, f"--lr_scheduler.warmup_steps={s.warmup_steps} must be >= 0"),
        (
            s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
            f"--lr_scheduler.decay_ratio={s.decay_ratio} must be in [0, 1]",
        ),
        (
            0 <= s.min_lr_factor <= 1,
            f"--lr_scheduler.min_lr_factor={s.min_lr_factor} must be in [0, 1]",
        ),
        (
            config.metrics.log_freq >= 1,
            f"--metrics.log_freq={config.metrics.log_freq} must be >= 1",
        ),
        (
            config.comm.init_timeout_seconds > 0,
            f"--comm.init_timeout_seconds={config.comm.init_timeout_seconds} must be > 0",
        ),
        (
            config.comm.train_timeout_seconds > 0,
            f"--comm.train_timeout_seconds={config.comm.train_timeout_seconds} must be > 0",
        ),
        (
            config.profiling.profile_freq
            >= config.profiling.profiler_warmup + config.profiling.profiler_active
            and config.profiling.profiler_active >= 1,
            f"--profiling.profile_freq={config.profiling.profile_freq} must be >= "
            f"profiler_warmup + profiler_active = {config.profiling.profiler_warmup} + "
            f"{config.profiling.profiler_active}, with profiler_active >= 1",
        ),
        (
            config.comm.dry_run_steps >= 0,
            f"--comm.dry_run_steps={config.comm.dry_run_steps} must be >= 0",
        ),
        (
            config.debug.device_memory_gib > 0,
            f"--debug.device_memory_gib={config.debug.device_memory_gib} must be > 0",
        ),
    ]
    p = config.parallelism
    for name in (
        "data_parallel_replicate_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
        "expert_parallel_degree",
    ):
        value = getattr(p, name)
        checks.append((value >= 1, f"--parallelism.{name}={value} must be >= 1"))
    dp_shard = p.data_parallel_shard_degree
    checks.append(
        (
            dp_shard == -1 or dp_shard >= 1,
            f"--parallelism.data_parallel_shard_degree={dp_shard} must be -1 (auto) or >= 1",
        )
    )
    c = config.checkpoint
    for flag, given in (
        ("--checkpoint.initial_load_path", c.initial_load_path is not None),
        ("--checkpoint.load_step", c.load_step != -1),
        ("--checkpoint.load_only", c.load_only),
    ):
        checks.append(
            (not given or c.enable, f"{flag} does nothing without --checkpoint.enable; add it")
        )
    checks += _local_tensor_checks(config)
    checks.append(
        (
            not (
                config.compile.enable
                and "model" in config.compile.components
                and p.tensor_parallel_degree > 1
            ),
            "--compile.enable with --parallelism.tensor_parallel_degree > 1 fails in backward "
            "on torch 2.13 (a compiled block hands a plain-tensor gradient to a DTensor op; "
            "scripts/repro_tp_compile.py); use --compile.components loss, or TP without compile",
        )
    )
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)

    module = import_model_module(config.model.name)
    flavors = getattr(module, "flavors", None)
    if flavors is not None and config.model.flavor not in flavors:
        raise ConfigError(
            f"--model.flavor {config.model.flavor} is not a {config.model.name} flavor"
            f"{_did_you_mean(config.model.flavor, flavors)}; available: {', '.join(flavors)}"
        )

    world_size = os.environ.get("WORLD_SIZE")
    if world_size is not None:
        if not world_size.isdigit() or int(world_size) < 1:
            raise ConfigError(f"WORLD_SIZE={world_size!r} must be a positive integer (set NGPU)")
        validate_parallelism(config, module, int(world_size))


def _local_tensor_checks(config: JobConfig) -> list[tuple[bool, str]]:
    """What cannot run with every rank simulated in one process (``COMM_MODE=local_tensor``),
    then what DTensor-parametrized sharding (``fsdp_impl simple``) cannot do anywhere."""
    p = config.parallelism
    checks = []
    if config.comm.mode == "local_tensor":
        why = "cannot run under COMM_MODE=local_tensor"
        checks = [
            (
                p.fsdp_impl != "fsdp2",
                f"--parallelism.fsdp_impl fsdp2 {why} (FSDP2 frees parameter storage with "
                "resize_, which LocalTensor lacks); use auto or simple",
            ),
            (not config.compile.enable, f"--compile.enable {why}; drop the flag"),
            (
                not (config.checkpoint.enable or config.checkpoint.create_seed_checkpoint),
                f"--checkpoint.enable / create_seed_checkpoint {why} (DCP cannot gather "
                "LocalTensors); drop the checkpoint flags",
            ),
            (
                not config.training.enable_cpu_offload,
                f"--training.enable_cpu_offload {why}; drop the flag",
            ),
        ]
    simple = _fsdp_impl(config) == "simple"
    return checks + [
        (
            not (simple and config.training.enable_cpu_offload),
            "--training.enable_cpu_offload needs --parallelism.fsdp_impl fsdp2",
        ),
        (
            not (simple and p.fsdp_reshard_after_forward == "always"),
            "--parallelism.fsdp_reshard_after_forward always needs --parallelism.fsdp_impl "
            "fsdp2 (simple keeps gathered parameters until backward)",
        ),
    ]


def validate_parallelism(
    config: JobConfig, module: types.ModuleType, world_size: int
) -> ParallelDims:
    """Degrees against the world size (``ParallelDimsError``), then against the model's dims."""
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
    model_check = getattr(module, "validate", None)
    if model_check is not None:
        model_check(config, parallel_dims)
    return parallel_dims


def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)


def save_resolved(config: JobConfig) -> Path | None:
    """Write the resolved config to ``<dump_folder>/<job.save_config_file>`` (``None``: off)."""
    name = config.job.save_config_file
    if name is None:
        return None
    path = Path(config.job.dump_folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(config))
    return path


def to_toml(config: JobConfig) -> str:
    """Serialise to TOML that ``--job.config_file`` reads back to the same config."""
    lines = []
    for section, values in to_dict(config).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            # TOML has no null: Optional fields use the CLI's spelling, the string "None".
            lines.append(f"{key} = {_toml_value('None' if value is None else value)}")
        lines.append("")
    return "\n".join(lines)


def format_config(config: JobConfig, fmt: Literal["text", "json", "toml"]) -> str:
    if fmt == "json":
        return json.dumps(to_dict(config), indent=2)
    if fmt == "toml":
        return to_toml(config)
    lines = []
    for section, values in to_dict(config).items():
        lines.append(f"{section}:")
        width = max(len(k) for k in values)
        lines.extend(f"  {k:<{width}}  {v!r}" for k, v in values.items())
    return "\n".join(lines)


def _select(argv: list[str]) -> _Selection:
    module, config, check_only, rest = DEFAULT_MODULE, None, False, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name in ("--module", "--config"):
            if eq:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise ConfigError(f"{name} needs a value, e.g. {name} llama3")
            if name == "--module":
                module = value
            else:
                config = value
        elif arg == "--check":
            check_only = True
        else:
            rest.append(arg)
        i += 1
    if config is None:
        config = (
            DEFAULT_CONFIG
            if module == DEFAULT_MODULE
            else f"{module.rsplit('.', 1)[-1]}_debugmodel"
        )
    return _Selection(module, config, check_only, rest)


def _find_flag_value(args: Sequence[str], flag: str) -> str | None:
    """Last value given for ``flag`` (either ``--flag v`` or ``--flag=v``; ``-`` or ``_``)."""
    value = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name[:2] == "--" and name[2:].replace("-", "_") == flag[2:]:
            if eq:
                value = inline
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


def _known_flags() -> set[str]:
    flags = set()
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(section.type):
            flags.add(f"--{section.name}.{f.name}")
            if f.type is bool:
                flags.add(f"--{section.name}.no_{f.name}")
    return flags


def _is_registry_function(obj: Any, registry: types.ModuleType) -> bool:
    return (
        callable(obj)
        and getattr(obj, "__module__", None) == registry.__name__
        and not getattr(obj, "__name__", "_").startswith("_")
        and isinstance(obj, types.FunctionType)
    )


def _did_you_mean(name: str, candidates: Any, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check a TOML value against a dataclass field type and convert ints to floats."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{where} = {value!r} must be one of {', '.join(map(repr, args))}")
    if origin in (types.UnionType, typing.Union):
        if type(None) in args and value == "None":
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(value, option, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} = {value!r} must be a list")
        return [_coerce(v, args[0], where) for v in value]
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ConfigError(f"{where} = {value!r} must be of type {annotation.__name__}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def _toml_string(value: str) -> str:
    """A TOML basic string: escape quotes, backslashes and control characters; keep the rest
    (including characters outside the BMP) as UTF-8, which TOML requires to be literal."""
    escaped = []
    for ch in value:
        if ch in ('"', "\\"):
            escaped.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            escaped.append(f"\\u{ord(ch):04x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        selection = _select(argv)
        config = parse_args(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if not selection.check_only:
        print(format_config(config, config.job.print_format))
    return 0


if __name__ == "__main__":
    sys.exit(main())

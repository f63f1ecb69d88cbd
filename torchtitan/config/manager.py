"""Resolve a trainer config from its layers, lowest first:

1. a named function from a model's ``config_registry`` (``--module llama3 --config llama3_8b``),
2. an optional TOML file (``--job.config_file run.toml``),
3. CLI overrides parsed by tyro (``--section.field value``, ``--section.no_flag``),

then one validation pass. Run ``python -m torchtitan.config.manager --module llama3
--config llama3_debugmodel [overrides]`` to print the result, ``--help`` for every flag.
Nothing here imports torch: resolving and validating a config takes well under a second.
"""

import dataclasses
import itertools
import json
import os
import sys
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import tomli
import tyro

from torchtitan.config import torchtitan_flags
from torchtitan.config.errors import ConfigError, did_you_mean
from torchtitan.config.job_config import JobConfig
from torchtitan.config.validation import resolve_auto, validate, validate_launch
from torchtitan.models.spec import get_model_spec

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
        prog=_prog(),
        description=_DESCRIPTION,
    )
    validate(config)
    resolve_auto(config)
    return config


def named_config(argv: Sequence[str] | None = None) -> JobConfig:
    """The named config that ``--module`` / ``--config`` in ``argv`` pick, before any TOML
    file or flag is applied."""
    selection = _select(list(sys.argv[1:] if argv is None else argv))
    return load_registry_config(selection.module, selection.config)


def _prog() -> str:
    """What the user typed, for ``--help``'s usage line: ``./run_train.sh`` (which passes
    ``--help`` to this module and says so in ``TITAN_HELP_PROG``) or the ``python -m`` module."""
    if prog := os.environ.get("TITAN_HELP_PROG"):
        return prog
    if not sys.argv or not sys.argv[0]:  # an interpreter's prompt
        return "./run_train.sh"
    entry = Path(sys.argv[0]).with_suffix("").as_posix()
    for module in ("torchtitan.config.manager", "torchtitan.train"):
        if entry.endswith("/" + module.replace(".", "/")):
            return f"python -m {module}"
    return "./run_train.sh"


def load_registry_config(module_name: str, config_name: str) -> JobConfig:
    """Call ``<module>.config_registry.<config_name>()``."""
    registry = get_model_spec(module_name).config_registry
    names = sorted(n for n, f in vars(registry).items() if _is_registry_function(f, registry))
    fn = getattr(registry, config_name, None)
    if fn is None or config_name not in names:
        raise ConfigError(
            f"--config {config_name} is not in {registry.__name__}"
            f"{did_you_mean(config_name, names)}; available: {', '.join(names)}"
        )
    config = fn()
    if not isinstance(config, JobConfig):
        raise ConfigError(f"{registry.__name__}.{config_name}() must return a JobConfig")
    return config


def apply_toml(config: JobConfig, path: str | os.PathLike) -> None:
    """Overwrite fields of ``config`` with the values of a TOML file, checking every key."""
    path = Path(path)
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()}, where the run starts)"
        raise ConfigError(
            f"--job.config_file {path} does not exist{where}; pass an existing TOML file"
        )
    try:
        with path.open("rb") as f:
            data = tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"--job.config_file {path} is not valid TOML: {e}") from None
    sections = {f.name: f for f in dataclasses.fields(config)}
    for section_name, values in data.items():
        if not isinstance(values, dict):
            # A top-level key (``foo = 1`` before any [section]) is not a section.
            where = "a top-level key" if section_name not in sections else f"[{section_name}]"
            raise ConfigError(
                f"{where} {section_name!r} in {path}: fields belong in a [section] table, "
                f"e.g. [training] steps = 10"
                + (did_you_mean(section_name, sections) if section_name not in sections else "")
            )
        if section_name not in sections:
            raise ConfigError(
                f"unknown section [{section_name}] in {path}{did_you_mean(section_name, sections)}"
            )
        section = getattr(config, section_name)
        hints = typing.get_type_hints(type(section))
        for key, value in values.items():
            if key not in hints:
                hint = torchtitan_flags.hint(
                    f"{section_name}.{key}", off=value is False
                ) or did_you_mean(key, hints, prefix=section_name + ".")
                raise ConfigError(f"unknown field {section_name}.{key} in {path}{hint}")
            where = f"{section_name}.{key} in {path}"
            setattr(section, key, _coerce(value, hints[key], where))


def check_cli_flags(args: Sequence[str]) -> None:
    """Reject unknown ``--section.field`` flags with a one-line did-you-mean error, and a value
    outside a field's choices (a ``Literal``) with a one-line list of them."""
    known, choices, numbers = _known_flags(), _literal_choices(), _number_fields()
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg in ("--help",):
            continue
        flag, has_value, value = arg.partition("=")
        normalized = "--" + flag[2:].replace("-", "_")
        if normalized not in known:
            canonical = sorted(k for k in known if ".no_" not in k)
            # --no_metrics.report -> metrics, report; --metrics.no_report -> metrics, no_report
            section, _, field = normalized[2:].removeprefix("no_").partition(".")
            off = normalized.startswith("--no_") or field.startswith("no_")
            hint = torchtitan_flags.hint(f"{section}.{field.removeprefix('no_')}", off=off)
            hint = hint or did_you_mean(normalized, canonical)
            if normalized.startswith("--no_") and f"--{section}.no_{field}" in known:
                # --no-metrics.report, as other tools spell it: here no_ follows the section.
                hint = f" (a flag turns off with no_ after its section: --{section}.no_{field})"
            raise ConfigError(f"unknown flag {flag}{hint}; see --help for all flags")
        # --flag=value, or the words up to the next flag (several for a list field).
        values = [value] if has_value else list(itertools.takewhile(_not_a_flag, args[i + 1 :]))
        if normalized in numbers:
            kind, optional = numbers[normalized]
            for value in values:
                _check_number(normalized, value, kind, optional)
        allowed = choices.get(normalized)
        if allowed is None:
            continue
        for value in values:
            if value not in allowed:
                # A choice in other letter case (adamw) before the closest spelling (Adam).
                same = [a for a in allowed if a.lower() == value.lower()]
                hint = f" (did you mean {same[0]}?)" if same else did_you_mean(value, allowed)
                raise ConfigError(
                    f"{normalized}={value} is not a choice: use one of {', '.join(allowed)}{hint}"
                )


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


def _item_types() -> Iterator[tuple[str, Any]]:
    """``(--section.field, type)`` of every field; a list field gives its items' type."""
    for section in dataclasses.fields(JobConfig):
        hints = typing.get_type_hints(section.type)
        for f in dataclasses.fields(section.type):
            hint = hints[f.name]
            if typing.get_origin(hint) is list:
                (hint,) = typing.get_args(hint)
            yield f"--{section.name}.{f.name}", hint


def _literal_choices() -> dict[str, tuple[str, ...]]:
    """``--section.field`` -> its allowed values, for fields typed ``Literal[...]`` or
    ``list[Literal[...]]``."""
    return {
        flag: tuple(map(str, typing.get_args(hint)))
        for flag, hint in _item_types()
        if typing.get_origin(hint) is Literal
    }


def _number_fields() -> dict[str, tuple[type, bool]]:
    """``--section.field`` -> (int or float, whether ``None`` is allowed), for fields typed
    ``int``, ``float``, their ``| None`` forms and lists of them."""
    numbers = {}
    for flag, hint in _item_types():
        optional = False
        if typing.get_origin(hint) in (types.UnionType, typing.Union):
            options = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = len(options) < len(typing.get_args(hint))
            hint = options[0] if len(options) == 1 else None
        if hint in (int, float):
            numbers[flag] = (hint, optional)
    return numbers


def _check_number(flag: str, value: str, kind: type, optional: bool) -> None:
    if optional and value == "None":
        return
    try:
        kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{flag}={value} is not {what}") from None


def _not_a_flag(arg: str) -> bool:
    return not arg.startswith("--")


def _is_registry_function(obj: Any, registry: types.ModuleType) -> bool:
    return (
        callable(obj)
        and getattr(obj, "__module__", None) == registry.__name__
        and not getattr(obj, "__name__", "_").startswith("_")
        and isinstance(obj, types.FunctionType)
    )


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
        if selection.check_only:
            validate_launch(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if not selection.check_only:
        print(format_config(config, config.job.print_format))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # --help | head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)

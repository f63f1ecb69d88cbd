"""Model registry.

A model is a Python package (``torchtitan.models.<name>`` or any importable module path) that
provides, without importing torch at package import time:

- ``config_registry``: a module of functions, each returning a full ``JobConfig``;
- ``flavors``: a mapping of flavor name -> model args (a dataclass);
- ``model_spec()``: returns a ``ModelSpec`` (this one may import torch).

Users add a model by writing such a package; nothing in the core needs to change.
"""

import dataclasses
import importlib
import types
from collections.abc import Callable, Mapping
from typing import Any

from torchtitan.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the trainer needs to build and parallelize one model family."""

    name: str
    flavors: Mapping[str, Any]
    build_model: Callable[..., Any]
    """``build_model(args) -> nn.Module``; called under the meta device."""
    parallelize: Callable[..., Any]
    """``parallelize(model, *, parallel_dims, training, parallelism, ...) -> nn.Module``."""


def import_model_module(name: str) -> types.ModuleType:
    """Import a model package from a short name (``llama3``) or a module path (``my.models.x``)."""
    candidates = [name] if "." in name else [f"torchtitan.models.{name}", name]
    for candidate in candidates:
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            # Only swallow "this candidate does not exist", never an import error inside it.
            missing = e.name or ""
            if not (candidate == missing or candidate.startswith(missing + ".")):
                raise
    raise ConfigError(
        f"model module {name!r} not found: tried {', '.join(candidates)}; pass --module / "
        "--model.name as a name under torchtitan.models or an importable module path"
    )

"""A Hugging Face model folder's description of itself: whether a folder is one, its
``config.json``, which of our families and flavors it is, its rotary embedding, and a check
that its other settings compute what ours do (the families' state-dict adapters call it).
"""

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class FusedPart:
    """What a state-dict adapter's ``to_hf`` returns for one of ``count`` of our tensors that
    together make one HF tensor (gpt-oss's and Llama 4's ``gate_up_proj``): ``tensor`` in the
    HF layout, part ``index`` along ``dim``, either in consecutive blocks (part i the i-th
    block) or ``interleaved`` (part i at i, i + count, ...). The export assembles the HF
    tensor once all parts are there, in the export's dtype."""

    tensor: Any
    index: int
    count: int
    dim: int = -1
    interleaved: bool = False

    def place(self, fused: Any) -> None:
        """Copy (and cast) this part into its entries of ``fused``."""
        dim = self.dim % fused.dim()
        size = self.tensor.shape[dim]
        where = [slice(None)] * fused.dim()
        if self.interleaved:
            where[dim] = slice(self.index, None, self.count)
        else:
            where[dim] = slice(self.index * size, (self.index + 1) * size)
        fused[tuple(where)] = self.tensor


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A Hugging Face model folder: ``config.json`` and safetensors weights."""
    path = Path(path)
    return (path / CONFIG).is_file() and ((path / INDEX).is_file() or (path / SINGLE).is_file())


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """An HF folder's ``config.json``."""
    return json.loads((Path(folder) / CONFIG).read_text())


def _adapter_class(spec):
    """The class behind a spec's ``state_dict_adapter`` (a ``lazy`` name or the class)."""
    adapter = spec.state_dict_adapter
    return adapter.resolve() if hasattr(adapter, "resolve") else adapter


def hf_family(folder: str | os.PathLike) -> str | None:
    """The model family (``--module``) under ``torchtitan.models`` whose adapter reads the HF
    folder's ``model_type`` (``None``: the folder names none, or no family reads it). A family
    that fails to import is skipped (its own runs say why)."""
    import pkgutil

    import torchtitan.models
    from torchtitan.models.spec import get_model_spec

    model_type = read_config(folder).get("model_type")
    if model_type is None:
        return None
    for package in pkgutil.iter_modules(torchtitan.models.__path__):
        if not package.ispkg:
            continue
        try:
            spec = get_model_spec(package.name)
            adapter = _adapter_class(spec) if spec.state_dict_adapter is not None else None
        except (ImportError, ConfigError, AttributeError):
            continue  # not a family (models/common), or one this install cannot load
        if model_type in _model_types(adapter):
            return spec.name
    return None


def matching_flavor(spec, folder: str | os.PathLike) -> str:
    """The flavor of ``spec`` whose shapes the HF folder's ``config.json`` has."""
    config = read_config(folder)
    model_types = _model_types(_adapter_class(spec))
    if config.get("model_type") not in (None, *model_types):
        names = " or ".join(repr(t) for t in model_types)
        raise ConfigError(
            f"{folder}: model_type {config['model_type']!r} is not {spec.name}'s "
            f"({names}); pass the --module that reads it"
        )
    for flavor, args in spec.flavors.items():
        try:
            spec.state_dict_adapter(args).check_hf_config(config, str(folder))
            return flavor
        except ConfigError:
            continue
    raise ConfigError(
        f"{folder}: no {spec.name} flavor has its shapes; pass the flavor (--model.flavor, or "
        "--flavor to the scripts)"
    )


def hf_rope(config: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """An HF ``config.json``'s rotary embedding: its base (``transformers``' default 10000
    where none is given), the scaling type (``default``: none) and the scaling's fields. Reads
    both forms (``rope_theta`` + ``rope_scaling``, and transformers 5's ``rope_parameters``)."""
    params = dict(config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", config.get("rope_theta"))
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return float(10000.0 if theta is None else theta), kind, scaling or {}


def check_computation(config: dict[str, Any], where: str, wanted: dict[str, Any]) -> None:
    """Refuse (one line) an HF model whose ``config.json`` sets one of ``wanted``'s fields to
    another value (absent or null: the field's default, taken as ours): norms' epsilon,
    activation, biases and the like, which change the logits without changing a shape."""
    other = [
        f"{k}={config[k]} (ours: {v})"
        for k, v in wanted.items()
        if config.get(k) is not None and config[k] != v
    ]
    if other:
        raise ConfigError(
            f"{where}: the HF model's {', '.join(other)} is not what this --model.flavor "
            "computes; it would give other logits"
        )


def _model_types(adapter) -> tuple:
    """The HF ``model_type`` values an adapter class reads (``model_types``, else its one
    ``model_type``)."""
    if adapter is None:
        return ()
    return getattr(adapter, "model_types", (getattr(adapter, "model_type", None),))

"""Qwen3 (dense). Llama 3's model, parallelization plans and pipeline split, with Qwen3's
per-head query/key norms and explicit head and FFN widths (``args.py``). Importing this
package does not import torch."""

import dataclasses

from torchtitan.models.llama3 import model_spec as llama3_spec
from torchtitan.models.llama3 import validate_args
from torchtitan.models.qwen3 import config_registry
from torchtitan.models.qwen3.args import Qwen3Args, flavors
from torchtitan.models.spec import lazy

__all__ = ["Qwen3Args", "config_registry", "flavors", "model_spec"]


def validate(config, parallel_dims) -> None:
    """Model-specific checks of a config against its parallel degrees (no torch import)."""
    validate_args(flavors[config.model.flavor], config, parallel_dims)


# Llama 3's model, plans, pipeline split and FLOP count, with Qwen3's flavors and HF mapping.
model_spec = dataclasses.replace(
    llama3_spec,
    name="qwen3",
    flavors=flavors,
    config_registry=config_registry,
    validate=validate,
    state_dict_adapter=lazy("torchtitan.models.qwen3.state_dict_adapter:Qwen3StateDictAdapter"),
)

"""Llama 4 (text): Llama 3's model, parallelization plans and pipeline split with chunked
attention, blocks without RoPE, weightless query/key norms and top-1 experts scaled on the
way in (``args.py``). Importing this package does not import torch."""

import dataclasses

from torchtitan.models.common.moe_args import check_hf_export_balancing
from torchtitan.models.llama3 import model_spec as llama3_spec
from torchtitan.models.llama3 import validate_args
from torchtitan.models.llama4 import config_registry
from torchtitan.models.llama4.args import Llama4Args, flavors
from torchtitan.models.spec import lazy

__all__ = ["Llama4Args", "config_registry", "flavors", "model_spec"]


def validate(config, parallel_dims) -> None:
    """Model-specific checks of a config against its parallel degrees (no torch import)."""
    args = flavors[config.model.flavor]
    validate_args(args, config, parallel_dims)
    check_hf_export_balancing(config, "Llama4ForCausalLM")


# Llama 3's model, plans, pipeline split and FLOP count, with Llama 4's flavors and HF mapping.
model_spec = dataclasses.replace(
    llama3_spec,
    name="llama4",
    flavors=flavors,
    config_registry=config_registry,
    validate=validate,
    state_dict_adapter=lazy("torchtitan.models.llama4.state_dict_adapter:Llama4StateDictAdapter"),
    has_experts=True,
    after_optimizer_step=lazy("torchtitan.models.common.moe:update_expert_biases"),
)

"""gpt-oss: Llama 3's model, parallelization plans and pipeline split with attention sinks,
sliding windows, biased projections, YaRN and biased experts with a clamped SwiGLU
(``args.py``). Importing this package does not import torch."""

import dataclasses

from torchtitan.models.common.moe_args import check_hf_export_balancing
from torchtitan.models.gpt_oss import config_registry
from torchtitan.models.gpt_oss.args import GptOssArgs, flavors
from torchtitan.models.llama3 import model_spec as llama3_spec
from torchtitan.models.llama3 import validate_args
from torchtitan.models.spec import lazy

__all__ = ["GptOssArgs", "config_registry", "flavors", "model_spec"]


def validate(config, parallel_dims) -> None:
    """Model-specific checks of a config against its parallel degrees (no torch import)."""
    args = flavors[config.model.flavor]
    validate_args(args, config, parallel_dims)
    check_hf_export_balancing(config, "GptOssForCausalLM")


# Llama 3's model, plans, pipeline split and FLOP count, with gpt-oss's flavors and HF mapping.
model_spec = dataclasses.replace(
    llama3_spec,
    name="gpt_oss",
    flavors=flavors,
    config_registry=config_registry,
    validate=validate,
    state_dict_adapter=lazy("torchtitan.models.gpt_oss.state_dict_adapter:GptOssStateDictAdapter"),
    has_experts=True,
    after_optimizer_step=lazy("torchtitan.models.common.moe:update_expert_biases"),
)

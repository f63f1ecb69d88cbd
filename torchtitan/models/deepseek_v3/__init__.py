"""DeepSeek-V3 (multi-head latent attention, mixture of experts). Importing this package does
not import torch; the model and its plans load when a run builds them."""

from torchtitan.models.common.moe_args import check_moe_run
from torchtitan.models.deepseek_v3 import config_registry
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args, check_parallel_degrees, flavors
from torchtitan.models.deepseek_v3.pipeline import pipeline_deepseek_v3
from torchtitan.models.spec import ModelSpec, lazy

__all__ = ["DeepSeekV3Args", "config_registry", "flavors", "model_spec"]


def validate(config, parallel_dims) -> None:
    """Model-specific checks of a config against its parallel degrees (no torch import)."""
    flavor = config.model.flavor
    check_moe_run(config, parallel_dims, "deepseek_v3")
    check_parallel_degrees(
        flavors[flavor],
        flavor=flavor,
        tp=parallel_dims.tp,
        ep=parallel_dims.ep,
        sequence_parallel=config.parallelism.enable_sequence_parallel,
        seq_len=config.training.seq_len,
        cp=parallel_dims.cp,
    )


model_spec = ModelSpec(
    name="deepseek_v3",
    flavors=flavors,
    config_registry=config_registry,
    build_model=lazy("torchtitan.models.deepseek_v3.model:Transformer"),
    parallelize=lazy("torchtitan.models.deepseek_v3.parallelize:parallelize_deepseek_v3"),
    flops_per_token=DeepSeekV3Args.flops_per_token,
    validate=validate,
    pipeline=pipeline_deepseek_v3,
    forward_keywords=("positions", "document_ids"),
    has_experts=True,
    after_optimizer_step=lazy("torchtitan.models.common.moe:update_expert_biases"),
    state_dict_adapter=lazy(
        "torchtitan.models.deepseek_v3.state_dict_adapter:DeepSeekV3StateDictAdapter"
    ),
)

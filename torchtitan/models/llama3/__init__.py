"""Llama 3 (and 3.1/3.2 sizes). Importing this package does not import torch, so the config
manager can list and validate configs quickly; ``model_spec()`` brings in the model."""

from torchtitan.models.llama3 import config_registry
from torchtitan.models.llama3.args import Llama3Args, check_parallel_degrees, flavors

__all__ = ["Llama3Args", "config_registry", "flavors", "model_spec", "validate"]


def validate(config, parallel_dims) -> None:
    """Model-specific checks of a config against its parallel degrees (no torch import)."""
    check_parallel_degrees(
        flavors[config.model.flavor],
        flavor=config.model.flavor,
        tp=parallel_dims.tp,
        sequence_parallel=config.parallelism.enable_sequence_parallel,
        seq_len=config.training.seq_len,
    )


def model_spec():
    from torchtitan.models import ModelSpec
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.parallelize import parallelize_llama3

    return ModelSpec(
        name="llama3", flavors=flavors, build_model=Transformer, parallelize=parallelize_llama3
    )

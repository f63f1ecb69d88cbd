"""Llama 3 (and 3.1/3.2 sizes). Importing this package does not import torch, so the config
manager can list and validate configs quickly; ``model_spec()`` brings in the model."""

from torchtitan.models.llama3 import config_registry
from torchtitan.models.llama3.args import Llama3Args, flavors

__all__ = ["Llama3Args", "config_registry", "flavors", "model_spec"]


def model_spec():
    from torchtitan.models import ModelSpec
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.parallelize import parallelize_llama3

    return ModelSpec(
        name="llama3", flavors=flavors, build_model=Transformer, parallelize=parallelize_llama3
    )

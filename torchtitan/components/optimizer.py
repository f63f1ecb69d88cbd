"""Optimizer built from the ``optimizer`` config section."""

import torch
from torch import nn

from torchtitan.config.job_config import Optimizer as OptimizerConfig

_CLASSES = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


def build_optimizer(
    model: nn.Module, config: OptimizerConfig, device: torch.device
) -> torch.optim.Optimizer:
    """Build over ``model``'s parameters; call it after sharding so states are sharded too.

    ``implementation=auto`` picks the fused kernel (CUDA and CPU have one) and falls back to
    ``foreach`` on other devices.
    """
    implementation = config.implementation
    if implementation == "auto":
        implementation = "fused" if device.type in ("cuda", "cpu") else "foreach"
    return _CLASSES[config.name](
        [p for p in model.parameters() if p.requires_grad],
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=implementation == "fused",
        foreach=implementation == "foreach",
    )

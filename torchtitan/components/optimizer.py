"""Optimizer built from the ``optimizer`` config section."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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
    # Fused and foreach kernels cannot mix DTensors with plain tensors (e.g. norms left
    # replicated by a TP plan without sequence parallelism): one param group per kind.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": kind}
        for kind in (
            [p for p in params if isinstance(p, DTensor)],
            [p for p in params if not isinstance(p, DTensor)],
        )
        if kind
    ]
    return _CLASSES[config.name](
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=implementation == "fused",
        foreach=implementation == "foreach",
    )

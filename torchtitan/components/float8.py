"""float8 training of linear layers with torchao (``--float8.enable``).

A model's parallelize function calls :func:`apply_float8` first, on the unsharded model, so
tensor parallelism and FSDP then wrap torchao's ``Float8Linear`` modules like any linear: each
matmul casts its inputs to float8 (e4m3, scaled per tensor or per row by the recipe) and runs
``torch._scaled_mm``; weights, gradients and optimizer state stay in high precision.

On CPU this is the real path (torch 2.13 has ``_scaled_mm`` for e4m3 there) but slower than
bf16: the CPU has no float8 units. On CUDA it needs compute capability 8.9+ (H100, L40, 4090)
unless ``--float8.emulate``. Communication in float8 (FSDP's float8 all-gather, tensorwise only)
needs NCCL: gloo cannot move float8 tensors, so it is refused on CPU before any rank starts.
"""

import dataclasses
import functools
import logging

import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Float8 as Float8Config
from torchtitan.tools.logging import logger

ALIGNMENT = 16
"""CUDA's float8 matmul needs both dims of a weight divisible by 16 (CPU does not; the same
filter keeps runs comparable across devices)."""


def apply_float8(model: nn.Module, config: Float8Config, *, autocast: bool) -> None:
    """Swap ``model``'s eligible ``nn.Linear`` modules for float8 ones, in place.
    ``autocast``: the run computes in bf16 through autocast (no casting FSDP policy)."""
    # torchao registers an enum with torch's pytree on import, which torch 2.13 warns about.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(
            "--float8.enable needs torchao: pip install 'torchao>=0.17,<0.19' (make setup "
            "installs it)"
        ) from None
    if torch.cuda.is_available() and not config.emulate:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"--float8.enable needs a GPU of compute capability 8.9+ (this one: "
                f"{major}.{minor}); pass --float8.emulate to check the numerics without speed"
            )
    if config.recipe_name == "rowwise_with_gw_hp" and autocast:
        raise ConfigError(
            "--float8.recipe_name rowwise_with_gw_hp fails under bf16 autocast in torchao "
            "(its weight gradient mixes a bf16 and a float32 matrix); train in float32 "
            "(--training.mixed_precision_param float32) or under FSDP's mixed precision"
        )
    if config.recipe_name == "tensorwise":
        f8 = Float8LinearConfig(
            enable_fsdp_float8_all_gather=config.enable_fsdp_float8_all_gather,
            emulate=config.emulate,
        )
    else:
        f8 = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(config.recipe_name), emulate=config.emulate
        )
    before = _linears(model)
    convert_to_float8_training(
        model, config=f8, module_filter_fn=functools.partial(wanted, filter_fqns=config.filter_fqns)
    )
    converted = before - _linears(model)
    logger.info(
        f"float8 ({config.recipe_name}): {converted} of {before} linear layers converted "
        f"(kept in high precision: names containing {config.filter_fqns} and dims not "
        f"divisible by {ALIGNMENT})"
    )


def wanted(module: nn.Module, fqn: str, *, filter_fqns: list[str]) -> bool:
    """Whether the linear ``module`` named ``fqn`` trains in float8."""
    if not isinstance(module, nn.Linear) or any(name in fqn for name in filter_fqns):
        return False
    return module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0


def _linears(model: nn.Module) -> int:
    """Plain ``nn.Linear`` modules (torchao's float8 linear is a subclass of its own type)."""
    return sum(type(m) is nn.Linear for m in model.modules())

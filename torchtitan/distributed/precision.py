"""The run's dtypes: what parameters are stored in, what the blocks compute in, and how.

``--training.dtype`` is the parameters' dtype, and so their gradients' and the optimizer's
states'. ``float32`` (the default) is mixed precision: the blocks compute in
``--training.mixed_precision_param``, cast either by data parallelism's policy (FSDP, HSDP,
replicate cast each unit's gathered parameters) or, with no such policy, by autocast.
``bfloat16`` stores the parameters in bf16 and computes in bf16 with nothing to cast: no
autocast, and a policy whose parameter dtype is theirs. Buffers keep their dtype (RoPE tables
and routing statistics stay float32).
"""

import contextlib

import torch
from torch import nn

from torchtitan.config.job_config import Training
from torchtitan.distributed.parallel_dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def param_dtype(training: Training) -> torch.dtype:
    """What the parameters, their gradients and the optimizer's states are stored in."""
    return DTYPES[training.dtype]


def compute_dtype(training: Training) -> str:
    """What the blocks compute in: bf16 parameters compute in bf16, float32 ones in
    ``mixed_precision_param``."""
    return "bfloat16" if training.dtype == "bfloat16" else training.mixed_precision_param


def policy_casts(parallel_dims: ParallelDims) -> bool:
    """Whether data parallelism's mixed-precision policy (FSDP, HSDP, replicate) casts the
    parameters to the compute dtype."""
    return parallel_dims.fsdp_enabled or parallel_dims.replicas_reduce_gradients


def uses_autocast(parallel_dims: ParallelDims, training: Training) -> bool:
    """bf16 compute of float32 parameters that no data-parallel policy casts."""
    return (
        training.dtype == "float32"
        and training.mixed_precision_param != "float32"
        and not policy_casts(parallel_dims)
    )


def autocast_context(
    parallel_dims: ParallelDims, training: Training, device_type: str
) -> contextlib.AbstractContextManager:
    """bf16 autocast where :func:`uses_autocast`, else nothing."""
    if not uses_autocast(parallel_dims, training):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def pipeline_dtypes(
    parallel_dims: ParallelDims, training: Training
) -> tuple[torch.dtype, torch.dtype]:
    """What pipeline stages send each other and what the last one outputs: with bf16
    parameters or a casting policy everything is bf16; under autocast the residual stream
    stays float32 (embeddings and residual adds are not autocast) and the logits are bf16."""
    if compute_dtype(training) == "float32":
        return torch.float32, torch.float32
    bf16 = training.dtype == "bfloat16" or policy_casts(parallel_dims)
    return (torch.bfloat16 if bf16 else torch.float32), torch.bfloat16


def cast_parameters_(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Give ``model``'s floating-point parameters ``dtype`` (on meta, before any parallelism
    wraps them), keeping its buffers as they are (``Module.to`` would cast both) and tied
    parameters tied."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in cast:
                cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            setattr(module, name, cast[id(p)])
    return model

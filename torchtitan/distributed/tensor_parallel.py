"""Tensor-parallel machinery shared by models: loss parallel and async TP.

The per-model plans (which module is colwise, rowwise, sequence parallel) live in each model's
``parallelize.py``; this module knows nothing about any model.
"""

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.config.errors import ConfigError


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocab-sharded logits without gathering them (forward and backward)."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def enable_async_tp(tp_mesh: DeviceMesh, *, compile_enabled: bool) -> None:
    """Let inductor overlap TP collectives with matmuls (CUDA + torch.compile only)."""
    if tp_mesh.device_type != "cuda":
        raise ConfigError(
            "--parallelism.enable_async_tensor_parallel needs CUDA (symmetric memory); "
            "remove it on CPU"
        )
    if not compile_enabled:
        raise ConfigError(
            "--parallelism.enable_async_tensor_parallel needs --compile.enable: inductor "
            "performs the overlap"
        )
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)

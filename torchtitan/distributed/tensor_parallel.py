"""Tensor-parallel machinery shared by models: loss parallel and async TP.

The per-model plans (which module is colwise, rowwise, sequence parallel) live in each model's
``parallelize.py``; this module knows nothing about any model.
"""

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocab-sharded logits without gathering them (forward and backward)."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor overlap TP collectives with matmuls. Needs CUDA and compiled blocks: the
    config pre-flight (``config/validation.py``) refuses it otherwise."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)

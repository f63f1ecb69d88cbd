"""How Llama 3 is parallelized: which modules each technique wraps. Plans only, no machinery."""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.job_config import Parallelism, Training
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import apply_fsdp, apply_replicate, mixed_precision_policy


def parallelize_llama3(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    world_mesh: DeviceMesh | None,
    training: Training,
    parallelism: Parallelism,
) -> nn.Module:
    """Apply data parallelism per transformer block (FSDP / HSDP / DDP-style replicate)."""
    if world_mesh is None:
        return model
    mp_policy = mixed_precision_policy(
        training.mixed_precision_param, training.mixed_precision_reduce
    )
    blocks = model.layers.values()
    if parallel_dims.fsdp_enabled:
        names = (
            ("dp_replicate", "dp_shard_cp")
            if parallel_dims.dp_replicate_enabled
            else ("dp_shard_cp",)
        )
        return apply_fsdp(
            model,
            blocks,
            world_mesh[names],
            mp_policy=mp_policy,
            reshard_after_forward=parallelism.fsdp_reshard_after_forward,
        )
    if parallel_dims.dp_replicate_enabled:
        return apply_replicate(model, blocks, world_mesh["dp_replicate"], mp_policy=mp_policy)
    return model

"""Pipeline stages open connections only to other ranks: torch 2.11's gloo refuses a send to
oneself, which V-shaped schedules (a rank holding two neighbouring stages) would make."""

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.distributed.pipeline_parallel import _Stage


def test_warm_up_sends_skip_the_stages_own_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        example = torch.zeros(2, 4)
        stage = _Stage(
            nn.Linear(4, 4),
            1,
            3,
            torch.device("cpu"),
            input_args=(example,),
            output_args=(example,),
            group=dist.group.WORLD,
        )
        # Stage 1 of 3: stage 0 on another rank, stage 2 on this one (a V turning here).
        stage.stage_index_to_group_rank = {0: 1, 1: 0, 2: 0}
        ops = stage._get_init_p2p_neighbors_ops()
        assert ops and all(op.group_peer == 1 for op in ops)
        assert len(ops) == 2  # a forward receive from stage 0 and a backward send to it
    finally:
        dist.destroy_process_group()


def test_stages_that_initialise_themselves_draw_apart():
    """Where each pipeline stage initialises its own weights (accelerators: DTensor's generator
    slices FSDP and TP shards out of one initialisation, but cannot replay earlier stages'
    draws), stage i draws from seed + i: no two stages' blocks start as copies, and stage 0
    starts as the one-process model does."""
    import functools

    from torchtitan.config.job_config import Parallelism
    from torchtitan.distributed.pipeline_parallel import cut_model
    from torchtitan.distributed.utils import build_full_init, init_model_weights
    from torchtitan.models.spec import get_model_spec

    spec = get_model_spec("llama3")
    args = spec.flavors["debugmodel"]
    names = spec.pipeline(args, 4, Parallelism())  # 4 stages of 1-2 blocks
    with torch.device("meta"):
        model = spec.build_model(args)
    parts = [cut_model(model, n) for n in names]
    build = functools.partial(spec.build_model, args)
    # Not distributed: the branch every accelerator run takes, whatever its device.
    init_model_weights(parts, build, seed=0, stage_indices=range(4), device=torch.device("cpu"))
    got = {k: v for part in parts for k, v in part.state_dict().items()}
    blocks = [n for stage in names for n in stage if n.startswith("layers.")]
    for weight in ("attention.wq.weight", "feed_forward.w1.weight"):
        values = [got[f"{block}.{weight}"] for block in blocks]
        assert all(not torch.equal(a, b) for i, a in enumerate(values) for b in values[i + 1 :])
    full = build_full_init(build, 0).state_dict()
    first = {k for k in parts[0].state_dict()}
    assert first and all(torch.equal(got[k], full[k]) for k in first)

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

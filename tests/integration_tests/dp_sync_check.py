"""Run under torchrun: train with the given flags, then check every rank holds the same
weights (replicated data parallelism) and the ranks really read different data."""

import os
import sys

import torch
import torch.distributed as dist

from torchtitan.config.manager import parse_args
from torchtitan.distributed.utils import shutdown
from torchtitan.tools.logging import init_logger
from torchtitan.trainer import Trainer


def main() -> None:
    init_logger()
    trainer = Trainer(parse_args(sys.argv[1:]))
    first_batch = next(iter(trainer.dataloader))[0]["input"]
    trainer.train()
    world = dist.get_world_size()
    (model,) = trainer.model_parts
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local.detach().contiguous())
        for rank, other in enumerate(gathered):
            assert torch.equal(other, gathered[0]), f"{name} differs between rank 0 and rank {rank}"
    batches = [torch.empty_like(first_batch) for _ in range(world)]
    dist.all_gather(batches, first_batch)
    assert not torch.equal(batches[0], batches[1]), "data-parallel ranks read the same data"
    if dist.get_rank() == 0:
        print("DP SYNC OK", flush=True)
    trainer.close()
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)

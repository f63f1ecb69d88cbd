"""Does torch.compile of a tensor-parallel block survive backward on this torch?

    python -m torch.distributed.run --nproc_per_node 2 scripts/repro_tp_compile.py [--no-sp]

Prints ``ok`` per rank when it does. On torch 2.13 (CPU, gloo; inductor and aot_eager alike)
backward fails with ``AttributeError: 'Tensor' object has no attribute '_local_tensor'``: the
compiled block's input is a view (what ``to_local()`` returns), and its gradient reaches DTensor's
``Redistribute`` as a plain tensor. torch 2.11 prints ``ok``. The trainer works around it by
copying such inputs before the graph (``torchtitan/distributed/compile.py``); this script keeps
the bare case, to see when torch fixes it.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class Block(nn.Module):
    """A residual block, as the transformer's: compiled as a whole, like each of its blocks."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.ff = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)


class Model(nn.Module):
    def __init__(self, vocab: int = 10, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = Block(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.emb(tokens)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-sp", action="store_true", help="no sequence parallelism")
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = f"cuda:{dist.get_rank() % torch.cuda.device_count()}" if cuda else "cpu"
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Model().to(device)
    between = Replicate() if args.no_sp else Shard(1)
    top = {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "out": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, top)
    block_plan = {
        "ff": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "ff.w1": ColwiseParallel(),
        "ff.w2": RowwiseParallel(output_layouts=between),
    }
    parallelize_module(model.block, mesh, block_plan)
    model.block = torch.compile(model.block, backend=args.backend, fullgraph=True)
    tokens = torch.randint(0, 10, (2, 8), device=device)
    model(tokens).sum().backward()
    print("ok", dist.get_rank(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""FSDP wiring: reshard-after-forward choices and deferred gradient reduction, observed as the
collectives backward issues (fake backend: one process plays rank 0 of 2)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.fsdp import apply_fsdp, mixed_precision_policy
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.parallelize import apply_data_parallel
from torchtitan.models.llama3.args import Llama3Args
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.spec import ParallelizeContext

ARGS = Llama3Args(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16)
c10d = torch.ops.c10d


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


def _backward_collectives(mesh, reshard: str, *, sync: bool = True) -> dict:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    policy = mixed_precision_policy("float32", "float32")
    apply_fsdp(model, model.layers.values(), mesh, mp_policy=policy, reshard_after_forward=reshard)
    model.set_requires_gradient_sync(sync)
    out = model(torch.randint(0, ARGS.vocab_size, (2, 16)))
    with CommDebugMode() as comm:
        out.sum().backward()
    return {op: n for op, n in comm.get_comm_counts().items() if n}


@pytest.mark.parametrize(
    ("reshard", "regathers"),
    [("default", ARGS.n_layers - 1), ("always", ARGS.n_layers), ("never", 0)],
)
def test_reshard_after_forward_decides_what_backward_gathers_again(mesh, reshard, regathers):
    counts = _backward_collectives(mesh, reshard)
    assert counts.get(c10d._allgather_base_, 0) == regathers
    # One gradient reduce-scatter per block and one for the root's parameters.
    assert counts[c10d._reduce_scatter_base_] == ARGS.n_layers + 1


def test_no_gradient_reduction_while_accumulating(mesh):
    counts = _backward_collectives(mesh, "default", sync=False)
    assert c10d._reduce_scatter_base_ not in counts


def _prefetched(module, units: list) -> tuple[list, list]:
    """The units ``module`` prefetches in forward and in backward (among ``units``)."""
    owner = {u._get_fsdp_state(): u for u in units}
    state = module._get_fsdp_state()
    forward = [owner[s] for s in state._states_to_forward_prefetch]
    return forward, [owner[s] for s in state._states_to_backward_prefetch]


def test_prefetch_lists_the_next_blocks_and_their_inner_units(mesh):
    """``prefetch=2``: each block gathers the next two blocks ahead, with the units sharded
    inside them (MoE experts), in the order they run: forward in block order, backward in
    reverse."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    blocks = list(model.layers.values())
    inner = [block.feed_forward for block in blocks]  # stand-ins for separately sharded experts
    for unit in inner:
        fully_shard(unit, mesh=mesh)
    policy = mixed_precision_policy("float32", "float32")
    apply_fsdp(model, blocks, mesh, mp_policy=policy, prefetch=2, inner_units=[[u] for u in inner])
    b, f, units = blocks, inner, [*blocks, *inner]
    assert _prefetched(b[0], units) == ([b[1], f[1], b[2], f[2]], [])
    assert _prefetched(b[2], units) == ([], [f[1], b[1], f[0], b[0]])
    assert _prefetched(f[0], units) == ([], [])  # the inner units keep FSDP's own order


def test_expert_weights_split_along_a_dim_that_divides_evenly(mesh):
    """FSDP pads an uneven dim 0: 2 experts over 8 ranks would leave a whole expert on each
    (4x the memory). Expert weights then split along a width that divides, one that tensor or
    expert parallelism does not split already; nothing divides: dim 0, padded."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchtitan.distributed.fsdp import expert_shard_dim

    assert expert_shard_dim(torch.empty(16, 8, 4), 8) == 0
    assert expert_shard_dim(torch.empty(2, 8, 4), 8) == 1
    assert expert_shard_dim(torch.empty(2, 6, 8), 8) == 2
    assert expert_shard_dim(torch.empty(2, 8), 4) == 1  # a bias
    assert expert_shard_dim(torch.empty(3, 5, 7), 8) == 0
    # Tensor parallelism splits dim 1 (2 ranks): its 4 local rows would divide over 4, but the
    # dim is taken.
    split = distribute_tensor(torch.empty(2, 8, 8), mesh, [Shard(1)])
    assert expert_shard_dim(split, 4) == 2


def test_cpu_offload_where_nothing_is_sharded_is_said_to_be_ignored(caplog):
    config = JobConfig()
    config.training.enable_cpu_offload = True
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    model = Transformer(ARGS)
    assert apply_data_parallel(model, ParallelizeContext.from_config(config, dims), []) is model
    assert "--training.enable_cpu_offload is ignored" in caplog.text

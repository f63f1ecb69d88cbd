"""The Llama 3 TP plan issues exactly the collectives it should (CommDebugMode on the fake
backend: one process plays rank 0 of 2; collectives are counted, not executed)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.components.loss import cross_entropy_sum
from torchtitan.distributed.tensor_parallel import loss_parallel_context
from torchtitan.models.llama3.args import Llama3Args
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import apply_tp

ARGS = Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16)
c10d = torch.ops.c10d_functional
AG, RS, AR = c10d.all_gather_into_tensor, c10d.reduce_scatter_tensor, c10d.all_reduce


@pytest.fixture(scope="module")
def tp_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


def _step(mesh, *, sequence_parallel: bool, loss_parallel: bool):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    apply_tp(model, mesh, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    with CommDebugMode() as forward:
        logits = model(tokens)
    with loss_parallel_context(loss_parallel):
        loss = cross_entropy_sum(logits, tokens)
        with CommDebugMode() as backward:
            loss.backward()
    return forward, backward


def _counts(mode: CommDebugMode) -> dict:
    return {op: n for op, n in mode.get_comm_counts().items() if n}


def test_sequence_and_loss_parallel_block_collectives(tp_mesh):
    forward, backward = _step(tp_mesh, sequence_parallel=True, loss_parallel=True)
    for i in range(ARGS.n_layers):
        for module in ("attention", "feed_forward"):
            # All-gather the sequence-sharded input, reduce-scatter the row-parallel output.
            counts = forward.comm_module_counts[f"Transformer.layers.{i}.{module}"]["forward"]
            assert dict(counts) == {AG: 1, RS: 1}, (i, module)
    # + the embedding's reduce-scatter and the output projection's all-gather; no logits gather.
    assert _counts(forward) == {AG: 2 * ARGS.n_layers + 1, RS: 2 * ARGS.n_layers + 1}
    assert _counts(backward) == {AG: 2 * ARGS.n_layers + 1, RS: 2 * ARGS.n_layers + 1}


def test_without_loss_parallel_the_logits_are_gathered(tp_mesh):
    forward, _ = _step(tp_mesh, sequence_parallel=True, loss_parallel=False)
    assert _counts(forward) == {AG: 2 * ARGS.n_layers + 2, RS: 2 * ARGS.n_layers + 1}


def test_without_sequence_parallel_row_outputs_are_all_reduced(tp_mesh):
    forward, backward = _step(tp_mesh, sequence_parallel=False, loss_parallel=True)
    # wo and w2 of each block, plus the embedding.
    assert _counts(forward) == {AR: 2 * ARGS.n_layers + 1}
    assert _counts(backward) == {AR: 2 * ARGS.n_layers + 1}

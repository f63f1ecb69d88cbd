"""The Llama 3 and DeepSeek-V3 TP plans issue exactly the collectives they should
(CommDebugMode on the fake backend: one process plays rank 0 of 2; collectives are counted,
not executed)."""

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
    return _count_collectives(model, torch.randint(0, ARGS.vocab_size, (2, 16)), loss_parallel)


def _count_collectives(model, tokens, loss_parallel: bool):
    """The collectives of one forward, and of one backward of the summed loss."""
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


def test_moe_layers_split_every_experts_hidden_width_and_reduce_once(tp_mesh):
    """DeepSeek-V3 under TP 2 with sequence parallelism and no expert parallelism: each rank
    holds half of every expert's hidden width (routed and shared), routes the gathered whole
    tokens, and returns a partial sum that one reduce-scatter brings back to its shard."""
    from torchtitan.models.deepseek_v3 import model_spec
    from torchtitan.models.deepseek_v3.parallelize import apply_tp as apply_deepseek_tp

    args = model_spec.args_for("debugmodel", seq_len=16)
    torch.manual_seed(0)
    model = model_spec.build_model(args)
    model.init_weights()
    apply_deepseek_tp(model, tp_mesh, loss_parallel=True, sequence_parallel=True)
    layer = model.layers["1"].moe
    hidden, dim = args.moe_inter_dim, args.dim
    assert layer.experts.w1.to_local().shape == (args.moe.num_experts, hidden // 2, dim)
    assert layer.experts.w2.to_local().shape == (args.moe.num_experts, dim, hidden // 2)
    assert layer.shared_experts.w1.weight.to_local().shape == (hidden // 2, dim)
    assert layer.shared_experts.w2.weight.to_local().shape == (dim, hidden // 2)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    forward, backward = _count_collectives(model, tokens, loss_parallel=True)
    n_moe = args.n_layers - args.n_dense_layers
    for i in range(args.n_dense_layers, args.n_layers):
        name = f"Transformer.layers.{i}.moe"
        # Gather the sequence shards in, reduce-scatter the partial sums out; nothing inside.
        assert dict(forward.comm_module_counts[name]["forward"]) == {AG: 1, RS: 1}, i
    # Backward, per MoE layer: the output's gradient gathered, the routing weights' gradient
    # all-reduced, the input's gradient (routed experts, shared experts and router together)
    # reduce-scattered. Attention adds three all-reduces per layer (wq, wkv_b, the shared
    # RoPE key); the dense FFN and the output projection a reduce-scatter each.
    assert _counts(backward) == {
        AG: args.n_layers + args.n_layers + 1,
        RS: args.n_dense_layers + 1 + n_moe,
        AR: 3 * args.n_layers + n_moe,
    }
    assert layer.experts.w1.grad is not None and layer.router.gate.weight.grad is not None


def test_clipping_first_sums_partial_gradients_into_their_parameters_placement(tp_mesh):
    """Sequence-parallel norm weights end backward with ``Partial`` gradients; clipping sums
    them first (torch 2.11's foreach clipping left ``Partial`` gradients unscaled)."""
    from torchtitan.distributed.utils import clip_grad_norm_

    torch.manual_seed(0)
    model = Transformer(ARGS)
    apply_tp(model, tp_mesh, loss_parallel=True, sequence_parallel=True)
    _count_collectives(model, torch.randint(0, ARGS.vocab_size, (2, 16)), loss_parallel=True)
    assert model.norm.weight.grad.placements[0].is_partial()
    clip_grad_norm_(model.parameters(), max_norm=1e-3)
    # (Values are the fake backend's: the placements are what is checked.)
    for name, p in model.named_parameters():
        assert not any(placement.is_partial() for placement in p.grad.placements), name

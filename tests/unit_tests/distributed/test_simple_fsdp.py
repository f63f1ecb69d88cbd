"""SimpleFSDP (+ TP) simulated in one process under LocalTensorMode trains exactly like one
process: same losses, gradient norms and weights after a few AdamW steps on the same global
batch, with gradients averaged over the data-parallel ranks."""

import functools

import pytest
import torch
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.local_tensor import (
    for_each_coordinate,
    load_full_model_,
    local_tensor_mode,
)
from torchtitan.distributed.simple_fsdp import apply_simple_fsdp, sharded_access
from torchtitan.distributed.tensor_parallel import loss_parallel_context
from torchtitan.models.llama3.args import Llama3Args
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import apply_tp

ARGS = Llama3Args(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16)
STEPS = 2
GLOBAL_BATCH = 4


def _full_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(
            0, ARGS.vocab_size, (GLOBAL_BATCH, ARGS.max_seq_len + 1), generator=g
        )
        labels = tokens[:, 1:].clone()
        labels[0, :3] = IGNORE_INDEX  # uneven token counts per data-parallel rank
        out.append((tokens[:, :-1], labels))
    return out


def _rows(batch: torch.Tensor, rows: int, dp_rank: int) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s rows of the global batch."""
    return batch[dp_rank * rows : (dp_rank + 1) * rows]


def _train(model, batches, *, dp: int, dp_rank, loss_mesh, loss_parallel: bool):
    """The trainer's step: sum-CE / global tokens x dp size, clip, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    rows = GLOBAL_BATCH // dp
    losses, norms, first_grads = [], [], {}
    for global_inputs, global_labels in batches:
        inputs = for_each_coordinate(functools.partial(_rows, global_inputs, rows), dp_rank)
        labels = for_each_coordinate(functools.partial(_rows, global_labels, rows), dp_rank)
        optimizer.zero_grad()
        global_tokens = dist_utils.dist_reduce((labels != IGNORE_INDEX).sum(), "sum", loss_mesh)
        with loss_parallel_context(loss_parallel):
            loss = cross_entropy_sum(model(inputs), labels)
            (loss * dp / global_tokens).backward()
        loss = loss.detach()
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        if not first_grads:
            first_grads = _full_values({n: p.grad for n, p in model.named_parameters()})
        norms.append(dist_utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        losses.append(dist_utils.dist_reduce(loss, "sum", loss_mesh) / global_tokens)
    return losses, norms, first_grads, _full_values(dict(model.named_parameters()))


def _full_values(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unsharded plain copies (a LocalTensor holding the same value on every rank -> that value)."""
    out = {}
    for name, t in tensors.items():
        full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        out[name] = full.reconcile() if isinstance(full, LocalTensor) else full.clone()
    return out


@pytest.fixture(scope="module")
def reference():
    full = _full_model()
    return _train(full, _batches(), dp=1, dp_rank=0, loss_mesh=None, loss_parallel=False)


def _simulated(dp: int, tp: int, *, check=None):
    # Weights and data are made outside the mode: inside, every new tensor is a LocalTensor.
    full, batches = _full_model(), _batches()
    with local_tensor_mode(dp * tp):
        dims = ParallelDims(
            dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=dp * tp
        )
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(ARGS)
        tp_mesh = None
        if tp > 1:
            tp_mesh = mesh["tp"]
            apply_tp(model, tp_mesh, loss_parallel=True, sequence_parallel=True)
        apply_simple_fsdp(model, dp_mesh=dims.mesh("dp_shard_cp"), tp_mesh=tp_mesh)
        load_full_model_(model, full)
        if check is not None:
            check(model, mesh)
        return _train(
            model,
            batches,
            dp=dp,
            dp_rank=dims.mesh("dp").get_local_rank(),
            loss_mesh=dims.mesh("dp_cp"),
            loss_parallel=tp > 1,
        )


def _assert_matches(run, ref):
    (losses, norms, grads, weights), (ref_losses, ref_norms, ref_grads, ref_weights) = run, ref
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # Adam hardly notices a gradient scale: the norms and the first gradients are what catch
    # gradients summed instead of averaged over the data-parallel ranks.
    assert norms == pytest.approx(ref_norms, rel=1e-4)
    assert grads.keys() == ref_grads.keys() == weights.keys() == ref_weights.keys()
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-7, msg=name)
    # Layouts sum in different orders (~1e-7); Adam's m / sqrt(v) amplifies that where
    # gradients are near zero: 2 steps at lr 1e-2 move a weight up to 2e-2, 1e-4 is 0.5% of it.
    for name, want in ref_weights.items():
        torch.testing.assert_close(weights[name], want, rtol=0, atol=1e-4, msg=name)


def _check_2d_placements(model, mesh):
    attn, ffn = model.layers["0"].attention, model.layers["0"].feed_forward
    expected = {
        # TP Shard(0) (colwise, embedding rows) -> FSDP on dim 1; TP Shard(1) -> FSDP on dim 0.
        attn.wq: (Shard(1), Shard(0)),
        ffn.w2: (Shard(0), Shard(1)),
        model.tok_embeddings: (Shard(1), Shard(0)),
        model.output: (Shard(1), Shard(0)),
        # Sequence-parallel norms are TP-replicated.
        model.layers["0"].attention_norm: (Shard(0), Replicate()),
    }
    for module, placements in expected.items():
        stored = module._parameters["weight"]
        assert isinstance(stored, DTensor)
        assert stored.device_mesh.mesh_dim_names == ("dp_shard_cp", "tp")
        assert stored.placements == placements, module
    # What the module computes with: gathered over dp, still TP-sharded on the tp mesh.
    gathered = attn.wq.weight
    assert gathered.device_mesh == mesh["tp"] and gathered.placements == (Shard(0),)
    assert gathered.to_local().shape == (ARGS.dim // 2, ARGS.dim)
    assert attn.wq._parameters["weight"].to_local().shape == (ARGS.dim // 2, ARGS.dim // 2)
    with sharded_access(model):
        assert attn.wq.weight is attn.wq._parameters["weight"]
    # State-dict names are the plain module names (checkpoints do not see the wrapper).
    assert "layers.0.attention.wq.weight" in model.state_dict()


def test_fsdp_tp_matches_one_process(reference):
    _assert_matches(_simulated(2, 2, check=_check_2d_placements), reference)


def test_fsdp_only_matches_one_process(reference):
    def check(model, mesh):
        stored = model.layers["0"].attention.wq._parameters["weight"]
        assert stored.placements == (Shard(0),)
        # No TP: the module computes with a plain tensor.
        assert not isinstance(model.layers["0"].attention.wq.weight, DTensor)

    _assert_matches(_simulated(2, 1, check=check), reference)

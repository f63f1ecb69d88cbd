"""Context-parallel attention equals full causal attention: outputs and the gradients of q, k
and v, on 2 and 4 real gloo ranks (torch's ring attention with the CPU kernels), both rotate
methods, with and without load balancing; and the same under ``LocalTensorMode``, where the
shim computes it by gathering K/V instead. Block-causal attention (K/V gathered, each rank's
queries masked by the whole sequence's documents) equals full block-causal attention the same
ways.

Run as a script under torchrun, this file is its own multi-rank harness.
"""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed import context_parallel
from torchtitan.models.common.attention import ScaledDotProductAttention

SHAPE = dict(bs=2, heads=4, kv_heads=2, seq=32, head_dim=16)
CASES = list(itertools.product((2, 4), ("allgather", "alltoall"), (True, False)))
BLOCK_CAUSAL_CASES = list(itertools.product((2, 4), (True, False)))
TOLERANCE = dict(rtol=1e-6, atol=1e-6)
# Row 0: documents starting inside, at and across the chunks of cp 2 and 4 (8 or 4 tokens);
# row 1: one document begun before the window, a second from the middle.
DOCUMENTS = torch.tensor([[0] * 3 + [1] * 5 + [2] * 7 + [3] * 9 + [4] * 8, [0] * 13 + [1] * 19])


def _full_attention(seed: int, block_causal: bool = False) -> dict[str, torch.Tensor]:
    """Inputs, output gradient, and the full attention's output and input gradients."""
    g = torch.Generator().manual_seed(seed)
    s = SHAPE
    q = torch.randn(s["bs"], s["heads"], s["seq"], s["head_dim"], generator=g)
    k, v = (torch.randn(s["bs"], s["kv_heads"], s["seq"], s["head_dim"], generator=g) for _ in "kv")
    grad_out = torch.randn(q.shape, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if block_causal:
        out = ScaledDotProductAttention()(*leaves, DOCUMENTS)
    else:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    out.backward(grad_out)
    grads = [t.grad for t in leaves]
    return dict(
        q=q, k=k, v=v, grad_out=grad_out, out=out.detach(), dq=grads[0], dk=grads[1], dv=grads[2]
    )


def _cp_attention(
    mesh, full: dict, rotate_method: str, load_balance: bool, block_causal: bool = False
) -> dict:
    """This rank's output and input gradients from the context-parallel module, next to the
    full attention's values at the same positions."""
    module = ScaledDotProductAttention()
    context_parallel.apply_cp(
        [module],
        mesh,
        rotate_method=rotate_method,
        load_balance=load_balance,
        gather=block_causal,
    )
    positions = context_parallel.rank_positions(SHAPE["seq"], mesh, load_balance)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(2, positions)

    leaves = [mine(full[n]).detach().requires_grad_() for n in "qkv"]
    out = module(*leaves, *((DOCUMENTS,) if block_causal else ()))
    out.backward(mine(full["grad_out"]))
    got = dict(out=out.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    want = {name: mine(full[name]) for name in got}
    return got, want


def _harness(out_file: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = {
        4: init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)),
        2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"],
    }
    errors = {}
    for i, (cp, rotate, balance) in enumerate(CASES):
        full = _full_attention(seed=i)
        got, want = _cp_attention(meshes[cp], full, rotate, balance)
        errors[f"cp{cp}_{rotate}_{'balanced' if balance else 'contiguous'}"] = {
            name: _mismatch(got[name], want[name]) for name in got
        }
    for i, (cp, balance) in enumerate(BLOCK_CAUSAL_CASES):
        full = _full_attention(seed=100 + i, block_causal=True)
        got, want = _cp_attention(meshes[cp], full, "allgather", balance, block_causal=True)
        errors[f"cp{cp}_block_causal_{'balanced' if balance else 'contiguous'}"] = {
            name: _mismatch(got[name], want[name]) for name in got
        }
    gathered = [None] * world
    dist.all_gather_object(gathered, errors)
    if rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    try:
        torch.testing.assert_close(got, want, **TOLERANCE)
    except AssertionError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp") / "errors.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", __file__, str(out)],
        env=env | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.integration
@pytest.mark.parametrize("cp, rotate, balance", CASES)
def test_ring_attention_equals_full_attention(ring_results, cp, rotate, balance):
    case = f"cp{cp}_{rotate}_{'balanced' if balance else 'contiguous'}"
    for rank, errors in enumerate(ring_results):
        assert errors[case] == dict(out=None, dq=None, dk=None, dv=None), (rank, case)


@pytest.mark.integration
@pytest.mark.parametrize("cp, balance", BLOCK_CAUSAL_CASES)
def test_gathered_block_causal_attention_equals_full_block_causal_attention(
    ring_results, cp, balance
):
    case = f"cp{cp}_block_causal_{'balanced' if balance else 'contiguous'}"
    for rank, errors in enumerate(ring_results):
        assert errors[case] == dict(out=None, dq=None, dk=None, dv=None), (rank, case)


@pytest.mark.parametrize("cp", (2, 4))
@pytest.mark.parametrize("balance", (True, False))
@pytest.mark.parametrize("block_causal", (False, True))
def test_simulated_ring_attention_equals_full_attention(cp, balance, block_causal):
    """Every rank simulated in one process: the shim's gathered path, per simulated rank."""
    from torchtitan.distributed.local_tensor import local_tensor_mode, value_on_rank

    full = _full_attention(seed=cp, block_causal=block_causal)
    with local_tensor_mode(cp):
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        got, want = _cp_attention(mesh, full, "allgather", balance, block_causal)
        for rank in range(cp):
            for name in got:
                torch.testing.assert_close(
                    value_on_rank(got[name], rank), value_on_rank(want[name], rank), **TOLERANCE,
                    msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}",
                )  # fmt: skip


def test_sequence_order_pairs_head_and_tail_chunks():
    order = context_parallel.sequence_order(8, 2, load_balance=True)
    assert order.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert context_parallel.sequence_order(8, 2, load_balance=False).tolist() == list(range(8))
    # Balanced, every rank computes the same number of causal query-key pairs.
    assert context_parallel.attention_work(64, 4, load_balance=True) == [0.25] * 4
    unbalanced = context_parallel.attention_work(64, 4, load_balance=False)
    assert unbalanced[-1] > 3 * unbalanced[0]


if __name__ == "__main__":
    _harness(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)

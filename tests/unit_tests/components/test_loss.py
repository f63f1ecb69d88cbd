"""The chunked cross-entropy (``--training.loss_chunks``) equals the one-piece loss, value and
gradient, and keeps only one chunk's float32 log-probabilities for backward."""

import pytest
import torch

from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_sum


def _batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 37, 300)).to(dtype).requires_grad_()
    labels = torch.randint(0, 300, (2, 37))
    labels[0, :5] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [2, 5, 74, 100])
def test_chunked_loss_and_gradient_equal_one_piece(dtype, chunks):
    logits, labels = _batch(dtype)
    want = cross_entropy_sum(logits, labels)
    (want_grad,) = torch.autograd.grad(want, logits)
    got = cross_entropy_sum(logits, labels, chunks=chunks)
    (got_grad,) = torch.autograd.grad(got, logits)
    assert got.dtype == want.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    atol = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=atol)


def test_chunks_keep_one_chunks_float32_copy_for_backward():
    """What autograd keeps between forward and backward, in bytes: the bf16 logits are the
    caller's; the one-piece loss adds its float32 log-probabilities of every token, the chunked
    loss only the inputs of its recomputation."""
    logits, labels = _batch(torch.bfloat16)

    def saved_bytes(chunks: int) -> int:
        sizes = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
                sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            cross_entropy_sum(logits, labels, chunks=chunks)
        return sum(sizes)

    full_float32 = logits.numel() * 4
    assert saved_bytes(1) >= full_float32
    assert saved_bytes(4) < full_float32 / 10

"""Training loss."""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""Label value that contributes neither loss nor token count."""


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, *, chunks: int = 1
) -> torch.Tensor:
    """Summed cross-entropy of ``logits [bs, seq, vocab]`` against ``labels [bs, seq]``.

    The trainer divides by the number of valid tokens over all accumulation batches and
    data-parallel ranks, so every token weighs the same however the batch is split. Computed in
    float32. With ``chunks`` > 1 the tokens are taken in that many chunks, each cast to float32
    and recomputed in backward, so the float32 copy of bf16 logits and the log-probabilities
    the loss keeps for backward exist for one chunk at a time; the logits themselves and their
    gradient still exist whole.
    """
    logits, labels = logits.flatten(0, 1), labels.flatten(0, 1)
    if chunks <= 1:
        return _float32_cross_entropy_sum(logits, labels)
    total = None
    # One split: its backward writes every chunk's gradient into one buffer.
    for part, part_labels in zip(logits.chunk(chunks), labels.chunk(chunks), strict=True):
        loss = checkpoint(
            _float32_cross_entropy_sum,
            part,
            part_labels,
            use_reentrant=False,
            preserve_rng_state=False,  # no randomness to replay
        )
        total = loss if total is None else total + loss
    return total


def _float32_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")

"""Training loss."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value that contributes neither loss nor token count."""


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``logits [bs, seq, vocab]`` against ``labels [bs, seq]``.

    The trainer divides by the number of valid tokens over all accumulation batches and
    data-parallel ranks, so every token weighs the same however the batch is split. Computed in
    float32.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )

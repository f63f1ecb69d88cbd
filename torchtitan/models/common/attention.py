"""The part of attention that sees whole sequences, as its own module, and the masks it takes.

A model's attention projects queries, keys and values and applies RoPE; the product over the
sequence happens in :class:`ScaledDotProductAttention`. Keeping it a module of its own lets
parallel plans reach it by name: context parallelism (``distributed/context_parallel.py``)
hooks it so the product runs as ring attention over the ranks that split the sequence.

Two masks (``--model.attn_mask``): plain ``causal`` (every earlier token of the window), and
``block_causal`` over packed documents (only the earlier tokens of the same document). The
batch runner gives the model each token's document number (``components.dataloader.
document_ids``), which every block's attention takes.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from torchtitan.tools.logging import logger


def block_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """``[bs, 1, seq, seq]`` bool, True where query i may attend to key j: j <= i and both in
    the same document (``documents [bs, seq]``: each token's document number)."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    same = documents.unsqueeze(2) == documents.unsqueeze(1)
    return (same & causal).unsqueeze(1)


class ScaledDotProductAttention(nn.Module):
    """Attention of queries ``[bs, h, seq, hd]`` over keys and values ``[bs, kv_h, seq, hd]``;
    grouped-query when ``kv_h < h`` (K/V heads are broadcast, not copied). Causal, or
    block-causal within ``documents [bs, seq]`` (each token's document number, ascending along
    a row). No parameters.

    Block-causal runs one causal SDPA call per document where the tensors are plain CPU ones
    in eager mode: on this CPU about 2x faster than SDPA with a dense mask, and faster than
    causal over the whole window (``benchmarks/bench_attention.py``). Elsewhere (compiled,
    DTensors, simulated or fake ranks, accelerators) the shapes must not depend on the data:
    SDPA with the dense :func:`block_causal_mask`. On an accelerator K/V heads are then
    repeated: CUDA's flash kernel (the only one that takes ``enable_gqa`` up to torch 2.13)
    refuses masks, and the math kernel left would hold every score. On CUDA the model hands
    a FlexAttention ``BlockMask`` instead (:func:`attention_documents`): measured on one H100
    with Llama 3 1B at 2 x 8,192 tokens, the dense mask ran at 65% of causal attention's
    tokens/s (docs/performance.md).

    ``scale``: the softmax temperature (default ``1 / sqrt(head dim)``). Value heads may be
    narrower than query/key heads (multi-head latent attention): they are padded with zeros to
    the query/key width and the output cut back, because the fused kernels take equal widths
    only. Otherwise CPU falls back to the math kernel (7x slower at 2,048 tokens on this CPU,
    and holding every score) and ring attention, which needs a fused kernel, fails.
    """

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: "torch.Tensor | BlockMask | None" = None,
    ) -> torch.Tensor:
        value_width = v.shape[-1]
        if value_width < q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - value_width))
            return self._attend(q, k, v, documents)[..., :value_width]
        return self._attend(q, k, v, documents)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: "torch.Tensor | BlockMask | None",
    ) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if isinstance(documents, BlockMask):
            return _compiled("flex_attention", flex_attention)(
                q, k, v, block_mask=documents, scale=self.scale, enable_gqa=gqa
            )
        if documents is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=gqa, scale=self.scale
            )
        if _eager_cpu(q, documents):
            return _per_document(q, k, v, documents, gqa, self.scale)
        mask = block_causal_mask(documents)
        if gqa and q.device.type not in ("cpu", "meta"):
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            gqa = False
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.scale
        )


def attention_documents(document_ids: torch.Tensor | None) -> "torch.Tensor | BlockMask | None":
    """What a model's blocks hand their attention for block-causal masking: on a GPU, a
    FlexAttention ``BlockMask`` built once per forward (outside compiled blocks), whose kernel
    skips the blocks of scores that the mask empties; elsewhere the document numbers as they
    are (see :class:`ScaledDotProductAttention`). Called by a model's top-level ``forward``."""
    if (
        document_ids is None
        or type(document_ids) is not torch.Tensor  # DTensors, simulated or fake ranks
        or document_ids.device.type != "cuda"
    ):
        return document_ids
    return block_causal_block_mask(document_ids)


def block_causal_block_mask(document_ids: torch.Tensor) -> BlockMask:
    """FlexAttention's block-causal mask of ``document_ids [bs, seq]``, built by a compiled
    function: eager, it would first fill the whole ``[bs, 1, seq, seq]`` mask (about 15 bytes
    per entry with temporaries: 2 GiB at 2 x 8,192 tokens)."""
    bs, seq = document_ids.shape

    def same_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    build = _compiled("create_block_mask", create_block_mask)
    try:
        return build(same_document_causal, bs, None, seq, seq, device=document_ids.device)
    except Exception as e:  # a compiler failure must not stop training: build it eagerly
        if build is create_block_mask:
            raise
        logger.warning(
            f"FlexAttention block mask: compiling create_block_mask failed "
            f"({type(e).__name__}: {str(e)[:200]}); building it eagerly (more memory)"
        )
        _COMPILED["create_block_mask"] = create_block_mask
        return create_block_mask(
            same_document_causal, bs, None, seq, seq, device=document_ids.device
        )


_COMPILED: dict[str, object] = {}


def _compiled(name: str, fn):
    """``torch.compile(fn)``, made once per process. FlexAttention needs compiling (eager,
    it holds every score); inside a compiled block the call is traced into the block's graph."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


def _eager_cpu(*tensors: torch.Tensor) -> bool:
    """Plain CPU tensors outside compilation: their values can be read on the host."""
    return not torch.compiler.is_compiling() and all(
        type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors
    )


def _per_document(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor,
    gqa: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal SDPA over each document of each row on its own, concatenated back."""
    rows = []
    for b, row in enumerate(documents):
        lengths = torch.unique_consecutive(row, return_counts=True)[1].tolist()
        pieces, start = [], 0
        for n in lengths:
            part = (t[b : b + 1, :, start : start + n] for t in (q, k, v))
            pieces.append(
                F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=gqa, scale=scale)
            )
            start += n
        rows.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    return torch.cat(rows)

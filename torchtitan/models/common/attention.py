"""The part of attention that sees whole sequences, as its own module, and the masks it takes.

A model's attention projects queries, keys and values and applies RoPE; the product over the
sequence happens in :class:`ScaledDotProductAttention`. Keeping it a module of its own lets
parallel plans reach it by name: context parallelism (``distributed/context_parallel.py``)
hooks it so the product runs as ring attention over the ranks that split the sequence.

Two masks (``--model.attn_mask``): plain ``causal`` (every earlier token of the window), and
``block_causal`` over packed documents (only the earlier tokens of the same document). The
batch runner gives the model each token's document number (``components.dataloader.
document_ids``), which every block's attention takes.

The queries may be a subset of the keys' positions (``query_positions``): under context
parallelism with block-causal attention a rank attends its own tokens' queries to the keys and
values of the whole sequence, gathered from every rank; the document numbers then cover the
whole sequence.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from torchtitan.models.common.sliding_window import sliding_window_attention
from torchtitan.tools.logging import logger


def block_causal_mask(
    documents: torch.Tensor, query_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """``[bs, 1, seq, seq]`` bool, True where query i may attend to key j: j <= i and both in
    the same document (``documents [bs, seq]``: each token's document number). With
    ``query_positions [bs, q]`` the queries sit at those positions of the sequence:
    ``[bs, 1, q, seq]``."""
    seq = documents.shape[1]
    if query_positions is None:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
        same = documents.unsqueeze(2) == documents.unsqueeze(1)
        return (same & causal).unsqueeze(1)
    keys = torch.arange(seq, device=documents.device)
    causal = keys[None, None, :] <= query_positions.unsqueeze(2)
    same = documents.gather(1, query_positions).unsqueeze(2) == documents.unsqueeze(1)
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

    def __init__(
        self, scale: float | None = None, window: int | None = None, chunk: int | None = None
    ):
        super().__init__()
        self.scale = scale
        self.window = window
        """Sliding window: a query sees only the ``window`` latest keys, itself included
        (``None``: every earlier key)."""
        self.chunk = chunk
        """Chunked attention (Llama 4): a query sees only the keys of its chunk of ``chunk``
        positions (and of its document), as if each chunk were a document of its own."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: "torch.Tensor | BlockMask | None" = None,
        query_positions: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query_positions [bs, q]``: where the queries sit in the keys' sequence when they
        are fewer (ascending runs; ``documents`` then cover the keys' whole sequence, and a
        ``BlockMask`` must have been built for these positions: :func:`attention_documents`).
        ``sinks [h]``: each query head's sink logit (:func:`with_sink`)."""
        value_width = v.shape[-1]
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        window = self.window if self.window is not None and self.window < k.shape[2] else None
        if self.chunk is not None and self.chunk < k.shape[2]:
            if isinstance(documents, BlockMask):
                raise ValueError("chunked attention takes document numbers, not a BlockMask")
            if query_positions is None and sinks is None and window is None:
                return self._chunked(q, k, v, documents, scale)[..., :value_width]
            # A rank's queries over the whole sequence (context parallelism): the chunks as
            # documents of their own.
            documents = chunk_documents(documents, k.shape[0], k.shape[2], self.chunk, k.device)
        if sinks is not None:
            q, k, v = with_sink(q, k, v, sinks, scale)
        elif value_width < q.shape[-1]:
            v = _pad_last(v, q.shape[-1] - value_width)
        if window is not None:
            if isinstance(documents, BlockMask):
                raise ValueError("a sliding window takes document numbers, not a BlockMask")
            out = sliding_window_attention(
                q, k, v, documents, query_positions, window=window, scale=scale,
                sink=sinks is not None,
            )  # fmt: skip
        else:
            out = self._attend(q, k, v, documents, query_positions, scale, sinks is not None)
        return out[..., :value_width]

    def _chunked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Chunked attention as a batch of chunks: each chunk of the sequence (the last one
        filled up with zeros, whose rows are dropped) attends causally, or block-causally with
        ``documents``, within itself: no mask over the whole sequence, so plain causal SDPA
        runs where there are no documents."""
        bs, _, seq, _ = q.shape
        chunk = self.chunk
        chunks = -(-seq // chunk)
        pad = chunks * chunk - seq

        def fold(t: torch.Tensor) -> torch.Tensor:  # [bs, h, seq, d] -> [bs * chunks, h, chunk, d]
            t = F.pad(t, (0, 0, 0, pad))
            heads, width = t.shape[1], t.shape[3]
            return (
                t.view(bs, heads, chunks, chunk, width)
                .transpose(1, 2)
                .reshape(-1, heads, chunk, width)
            )

        if documents is not None:  # (the filling takes the last token's document)
            documents = torch.cat([documents, documents[:, -1:].expand(bs, pad)], dim=1)
            documents = documents.view(bs * chunks, chunk)
        out = self._attend(fold(q), fold(k), fold(v), documents, None, scale, False)
        heads, width = out.shape[1], out.shape[3]
        out = out.view(bs, chunks, heads, chunk, width).transpose(1, 2)
        return out.reshape(bs, heads, chunks * chunk, width)[:, :, :seq]

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: "torch.Tensor | BlockMask | None",
        query_positions: torch.Tensor | None,
        scale: float,
        sink: bool,
    ) -> torch.Tensor:
        """Causal or block-causal attention; with ``sink`` the keys and values hold the sink
        first (:func:`with_sink`), which every query sees."""
        gqa = q.shape[1] != k.shape[1]
        if isinstance(documents, BlockMask):
            if sink:
                raise ValueError("attention sinks take document numbers, not a BlockMask")
            return _compiled("flex_attention", flex_attention)(
                q, k, v, block_mask=documents, scale=scale, enable_gqa=gqa
            )
        if documents is None and query_positions is None:
            if gqa and _no_fused_gqa(q):
                k, v = _repeat_heads(k, v, q.shape[1])
                gqa = False
            return _causal(q, k, v, gqa=gqa, scale=scale, sink=sink)
        if documents is None:  # causal over the whole sequence: one document
            keys = k.shape[2] - sink
            documents = torch.zeros(k.shape[0], keys, dtype=torch.long, device=k.device)
        if query_positions is None and _eager_cpu(q, k, v, documents):  # the whole sequence's
            query_positions = torch.arange(q.shape[2]).expand(q.shape[0], -1)
        if query_positions is not None and _eager_cpu(q, k, v, documents, query_positions):
            return _per_document(q, k, v, documents, query_positions, gqa, scale, sink)
        mask = block_causal_mask(documents, query_positions)
        if sink:
            mask = with_sink_column(mask)
        if gqa and q.device.type not in ("cpu", "meta"):
            k, v = _repeat_heads(k, v, q.shape[1])
            gqa = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


def chunk_documents(
    documents: torch.Tensor | None, bs: int, seq: int, chunk: int, device: torch.device
) -> torch.Tensor:
    """Document numbers ``[bs, seq]`` that also change at every multiple of ``chunk``
    (``documents`` ``None``: one document), still ascending along a row: block-causal
    attention over them is attention within each chunk of each document."""
    # Truncating, not flooring (the same here): torch 2.13's inductor on CPU gives garbage in
    # the last vector lanes of a floored arange added to a wider tensor (measured).
    chunks = torch.arange(seq, device=device).div(chunk, rounding_mode="trunc")
    if documents is None:
        return chunks.expand(bs, -1)
    return documents * -(-seq // chunk) + chunks


def with_sink(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values widened so that plain SDPA computes attention with a sink
    per head (gpt-oss): a logit ``sinks[h]`` in every row's softmax that adds nothing to the
    output, so a head may attend to nothing. The sink becomes key 0 (unit vector in one extra
    column, zero value) and each query of head ``h`` carries ``sinks[h] / scale`` in that
    column: the query-key products are unchanged, each query's product with the sink is
    ``sinks[h]``, and the sink's gradient flows back through the queries. Grouped-query
    heads share the sink key. Widths round up to a multiple of 8 (the fused kernels' rule);
    ``scale`` must be given explicitly (the default would follow the new width). The sink key
    must be visible to every query: :func:`with_sink_column` for masks, a leading query for
    causal calls (:func:`_causal`)."""
    bs, heads, queries, width = q.shape
    wide = -(-(max(width + 1, v.shape[-1])) // 8) * 8
    logits = (sinks.float() / scale).to(q.dtype).view(1, heads, 1, 1)
    logits = logits.expand(bs, heads, queries, 1)
    q = torch.cat([q, logits, q.new_zeros(bs, heads, queries, wide - width - 1)], dim=-1)
    k, v = _pad_last(k, wide - k.shape[-1]), _pad_last(v, wide - v.shape[-1])
    sink_key = k.new_zeros(1, 1, 1, wide)
    sink_key[..., width] = 1
    k = torch.cat([sink_key.expand(k.shape[0], k.shape[1], 1, wide), k], dim=2)
    v = torch.cat([v.new_zeros(v.shape[0], v.shape[1], 1, wide), v], dim=2)
    return q, k, v


def with_sink_column(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask ``[..., q, keys]`` with the sink's key in front, visible to every query."""
    return torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)


def _causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, gqa: bool, scale: float, sink: bool
) -> torch.Tensor:
    """Causal SDPA of queries over keys at the same positions; with ``sink`` the keys hold the
    sink first and a zero query goes in front, so that the causal mask (aligned to the top
    left) shows query i the sink and keys 0..i, without a mask tensor."""
    if not sink:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    q = torch.cat([q.new_zeros(*q.shape[:2], 1, q.shape[3]), q], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    return out[:, :, 1:]


def _no_fused_gqa(q: torch.Tensor) -> bool:
    """Whether grouped-query SDPA would fall to the math kernel: on CUDA only flash takes
    ``enable_gqa`` (up to torch 2.13), and flash takes no float32. The math kernel holds every
    score and, on context parallelism's sequence-sharded DTensors, fails outright (mixed
    Tensor and DTensor); with the K/V heads repeated the memory-efficient kernel runs."""
    return q.device.type == "cuda" and q.dtype == torch.float32


def _repeat_heads(
    k: torch.Tensor, v: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[bs, kv_h, seq, hd]`` with each head repeated to ``heads`` heads."""
    repeats = heads // k.shape[1]
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with ``width`` zeros appended to its last dim. A DTensor (context parallelism's
    sequence shards) is padded shard by shard: torch 2.11 turns a padded sequence-sharded
    DTensor into a replicated one (the whole sequence on every rank), and ring attention's
    CPU kernels then read values of the wrong length and corrupt the heap. torch 2.13 keeps
    the shards either way."""
    if isinstance(t, DTensor):
        local = F.pad(t.to_local(), (0, width))
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False)
    return F.pad(t, (0, width))


def attention_documents(
    document_ids: torch.Tensor | None, positions: torch.Tensor | None = None
) -> "torch.Tensor | BlockMask | None":
    """What a model's blocks hand their attention for block-causal masking: on a GPU, a
    FlexAttention ``BlockMask`` built once per forward (outside compiled blocks), whose kernel
    skips the blocks of scores that the mask empties; elsewhere the document numbers as they
    are (see :class:`ScaledDotProductAttention`). Called by a model's top-level ``forward``
    with the keywords it got.

    ``positions [bs, local seq]`` (context parallelism): the model holds the tokens at those
    positions while ``document_ids`` cover the whole sequence, whose keys its attention sees
    (``distributed.context_parallel``); the mask is built for those queries."""
    if (
        document_ids is None
        or type(document_ids) is not torch.Tensor  # DTensors, simulated or fake ranks
        or document_ids.device.type != "cuda"
    ):
        return document_ids
    return block_causal_block_mask(document_ids, positions)


def block_causal_block_mask(
    document_ids: torch.Tensor, query_positions: torch.Tensor | None = None
) -> BlockMask:
    """FlexAttention's block-causal mask of ``document_ids [bs, seq]`` (for queries at
    ``query_positions [bs, q]`` when given, the same in every row), built by a compiled
    function: eager, it would first fill the whole ``[bs, 1, seq, seq]`` mask (about 15 bytes
    per entry with temporaries: 2 GiB at 2 x 8,192 tokens)."""
    bs, seq = document_ids.shape
    if query_positions is None:

        def same_document_causal(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

        queries = seq
    else:
        where = query_positions[0]
        queries = where.shape[0]

        def same_document_causal(b, h, q_idx, kv_idx):
            position = where[q_idx]
            return (kv_idx <= position) & (document_ids[b, position] == document_ids[b, kv_idx])

    build = _compiled("create_block_mask", create_block_mask)
    try:
        return build(same_document_causal, bs, None, queries, seq, device=document_ids.device)
    except Exception as e:  # a compiler failure must not stop training: build it eagerly
        if build is create_block_mask:
            raise
        logger.warning(
            f"FlexAttention block mask: compiling create_block_mask failed "
            f"({type(e).__name__}: {str(e)[:200]}); building it eagerly (more memory)"
        )
        _COMPILED["create_block_mask"] = create_block_mask
        return create_block_mask(
            same_document_causal, bs, None, queries, seq, device=document_ids.device
        )


_COMPILED: dict[str, object] = {}


def _compiled(name: str, fn):
    """``torch.compile(fn)``, made once per process. FlexAttention needs compiling (eager,
    it holds every score). Inside a compiled block ``fn`` itself, which is traced into the
    block's graph; the cache is not touched there (Dynamo refuses a change of module state
    inside a checkpointed block: "HOP: Unsafe side effect")."""
    if torch.compiler.is_compiling():
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


def _eager_cpu(*tensors: torch.Tensor) -> bool:
    """Plain CPU tensors outside compilation: their values can be read on the host."""
    return not torch.compiler.is_compiling() and all(
        type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors
    )


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _attend_after_earlier_keys(
    q: torch.Tensor,
    k_earlier: torch.Tensor,
    v_earlier: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """Queries that see every earlier key and, causally, the keys at their own positions (a
    causal mask aligned to the bottom right), on CPU without a mask: a masked SDPA call turns
    its ``[q, k]`` mask into floats and keeps them for backward (about 400 MiB per rank over
    the debug model's 6 blocks at 8,192 tokens under CP 2). Under autocast, in its dtype."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    # The kernel called directly (not through SDPA) needs unit stride along the head dim.
    tensors = (
        t.to(dtype) if t.stride(-1) == 1 else t.to(dtype).contiguous()
        for t in (q, k_earlier, v_earlier, k_own, v_own)
    )
    with torch.autocast("cpu", enabled=False):
        return _EarlierThenCausal.apply(*tensors, scale)


class _EarlierThenCausal(torch.autograd.Function):
    """Attention over two key sets, earlier keys (no mask) and the queries' own (causal),
    merged by their log-sum-exp as ring attention merges its shards. Backward runs the fused
    kernel's backward on each set with the merged output and log-sum-exp, which gives each
    set's exact share of the gradients."""

    @staticmethod
    def forward(ctx, q, k_earlier, v_earlier, k_own, v_own, scale):
        out_earlier, lse_earlier = _CPU_FLASH(q, k_earlier, v_earlier, 0.0, False, scale=scale)
        out_own, lse_own = _CPU_FLASH(q, k_own, v_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_earlier, lse_own)
        out = (
            torch.exp(lse_earlier - lse).unsqueeze(-1) * out_earlier
            + torch.exp(lse_own - lse).unsqueeze(-1) * out_own
        ).to(q.dtype)
        ctx.save_for_backward(q, k_earlier, v_earlier, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_earlier, v_earlier, k_own, v_own, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq_earlier, dk_earlier, dv_earlier = _CPU_FLASH_BACKWARD(
            grad_out, q, k_earlier, v_earlier, out, lse, 0.0, False, scale=ctx.scale
        )
        dq_own, dk_own, dv_own = _CPU_FLASH_BACKWARD(
            grad_out, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale
        )
        return dq_earlier + dq_own, dk_earlier, dv_earlier, dk_own, dv_own, None


def _per_document(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor,
    query_positions: torch.Tensor,
    gqa: bool,
    scale: float | None = None,
    sink: bool = False,
) -> torch.Tensor:
    """Block-causal SDPA of queries at ``query_positions [bs, q]`` over the whole sequence's
    keys: one call per run of queries that are consecutive and in one document, over the keys
    from that document's start to the run's last query; where the run starts after its
    document does, every earlier key and causally its own (:func:`_attend_after_earlier_keys`).
    With the whole sequence's queries: one causal call per document. With ``sink`` the keys
    and values hold the sink first (:func:`with_sink`), which every call includes."""
    seq = documents.shape[1]
    index = torch.arange(seq)
    rows = []
    for b in range(q.shape[0]):
        row = documents[b]
        new = torch.ones(seq, dtype=torch.bool)
        new[1:] = row[1:] != row[:-1]
        starts = torch.cummax(torch.where(new, index, 0), 0).values  # each token's doc start
        positions = query_positions[b]
        # A run ends before a query that does not follow its predecessor or is in another
        # document: a few breaks per row, found without a Python loop over the queries.
        breaks = torch.ones(len(positions) + 1, dtype=torch.bool)
        breaks[1:-1] = (positions[1:] != positions[:-1] + 1) | (
            starts[positions[1:]] != starts[positions[:-1]]
        )
        bounds = breaks.nonzero().flatten().tolist()
        first_positions = positions[bounds[:-1]].tolist()
        first_starts = starts[positions[bounds[:-1]]].tolist()
        pieces = []
        for first, last, begin, start in zip(
            bounds[:-1], bounds[1:], first_positions, first_starts, strict=True
        ):
            end = begin + last - first
            queries = q[b : b + 1, :, first:last]
            keys, values = (t[b : b + 1, :, start + sink : end + sink] for t in (k, v))
            sink_kv = [t[b : b + 1, :, :1] for t in (k, v)] if sink else []
            if start == begin:  # the run starts its document: plain causal
                if sink:
                    keys, values = (
                        torch.cat(pair, dim=2) for pair in zip(sink_kv, (keys, values), strict=True)
                    )
                out = _causal(queries, keys, values, gqa=gqa, scale=scale, sink=sink)
            else:  # earlier keys of its document all visible, then causal over its own
                split = begin - start
                earlier = [t[:, :, :split] for t in (keys, values)]
                if sink:  # the sink goes with the keys every query sees
                    earlier = [
                        torch.cat(pair, dim=2) for pair in zip(sink_kv, earlier, strict=True)
                    ]
                out = _attend_after_earlier_keys(
                    queries, *earlier, keys[:, :, split:], values[:, :, split:], scale
                )
            pieces.append(out)
        rows.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    return torch.cat(rows)

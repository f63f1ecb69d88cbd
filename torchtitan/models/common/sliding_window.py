"""Sliding-window attention: each query sees only the ``window`` latest keys of its sequence
(itself included), as gpt-oss's every other block does.

The queries are cut into blocks of consecutive positions; a block of ``B`` queries needs only
the ``B + window - 1`` keys that end at its last query, gathered per block, so one batched
SDPA call with a small mask ``[B, B + window - 1]`` per block computes the band: about
``B + window`` key products per query instead of the whole row, and no ``[seq, seq]`` mask.
Shapes do not depend on the data: the same code runs eager, compiled, on accelerators and on
simulated ranks. Document numbers (block-causal attention over packed documents) and a sink
key in front (``attention.with_sink``) narrow the mask.
"""

import torch
import torch.nn.functional as F


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    *,
    window: int,
    scale: float,
    sink: bool = False,
) -> torch.Tensor:
    """Attention of queries ``[bs, h, q, hd]`` over keys and values ``[bs, kv_h, seq, hd]``
    within the last ``window`` positions (and the query's document, with ``documents
    [bs, seq]``). ``query_positions [bs, q]`` (context parallelism: the same in every row) puts
    the queries at those positions of the keys' sequence, in at most two runs of equal length
    (the load-balanced layout) or one; ``None``: the queries are the whole sequence. With
    ``sink``, key 0 is the sink, which every query sees (not counted in ``seq``)."""
    bs, heads, queries, width = q.shape
    kv_heads, seq = k.shape[1], k.shape[2] - sink
    if query_positions is None:
        # Blocks of one window; the last filled up with queries past the end (each sees at
        # least the last key: fewer than a window past it), whose rows are dropped.
        block = min(window, queries)
        padded = -(-queries // block) * block
        positions = torch.arange(padded, device=q.device)
        q = F.pad(q, (0, 0, 0, padded - queries))
    else:
        positions, padded = query_positions[0], queries
        block = _block_size(queries // (2 if queries % 2 == 0 else 1), window)
    blocks = padded // block
    span = block + window - 1
    query_at = positions.view(blocks, block)
    _check_consecutive(query_at)
    # Each block's keys: the span ending at its last query (outside the sequence: masked).
    key_at = query_at[:, :1] - (window - 1) + torch.arange(span, device=q.device)  # [blocks, span]
    index = key_at.clamp(0, seq - 1)
    mask = (
        (key_at[:, None, :] <= query_at[:, :, None])
        & (key_at[:, None, :] > query_at[:, :, None] - window)
        & (key_at[:, None, :] >= 0)
        & (key_at[:, None, :] < seq)
    ).unsqueeze(0)  # [1, blocks, block, span]
    if documents is not None:
        query_docs = documents.index_select(1, positions.clamp(max=seq - 1))
        query_docs = query_docs.view(bs, blocks, block, 1)
        key_docs = documents.index_select(1, index.flatten()).view(bs, blocks, 1, span)
        mask = mask & (query_docs == key_docs)
    mask = mask.expand(bs, blocks, block, span)
    keys, values = (_per_block(t[:, :, sink:], index, width) for t in (k, v))
    if sink:  # key 0 of every block, seen by every query
        keys, values = (
            torch.cat([t[:, :, :1].repeat_interleave(blocks, dim=0), per], dim=2)
            for t, per in ((k, keys), (v, values))
        )
        mask = torch.cat([mask.new_ones(bs, blocks, block, 1), mask], dim=-1)
    qs = q.reshape(bs, heads, blocks, block, width).transpose(1, 2)
    qs = qs.reshape(-1, heads, block, width)
    gqa = heads != kv_heads
    if gqa and q.device.type not in ("cpu", "meta"):  # (see attention._attend)
        keys, values = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
        gqa = False
    out = F.scaled_dot_product_attention(
        qs, keys, values, attn_mask=mask.reshape(bs * blocks, 1, block, -1),
        enable_gqa=gqa, scale=scale,
    )  # fmt: skip
    out = out.view(bs, blocks, heads, block, width).transpose(1, 2).reshape(q.shape)
    return out[:, :, :queries]


def _per_block(t: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """``t [bs, kv_h, seq, w]`` gathered at ``index [blocks, span]``:
    ``[bs * blocks, kv_h, span, w]``."""
    bs, kv_heads = t.shape[:2]
    blocks, span = index.shape
    gathered = t.index_select(2, index.flatten()).view(bs, kv_heads, blocks, span, width)
    return gathered.transpose(1, 2).reshape(bs * blocks, kv_heads, span, width)


def _block_size(run: int, window: int) -> int:
    """The largest divisor of ``run`` (queries at consecutive positions) up to ``window``:
    blocks never straddle two runs, and a block's keys span at most ``2 x window`` (context
    parallelism's runs are ``seq_len / (2 cp)``: a window's divisor where both are powers
    of two)."""
    return next(size for size in range(min(run, window), 0, -1) if run % size == 0)


def _check_consecutive(query_at: torch.Tensor) -> None:
    """Eager, on the host: every block's queries sit at consecutive positions (the keys
    gathered for a block cover only those)."""
    if torch.compiler.is_compiling() or type(query_at) is not torch.Tensor:
        return
    if query_at.device.type == "cpu" and query_at.shape[1] > 1:
        if not bool((query_at.diff(dim=1) == 1).all()):
            raise ValueError(
                "sliding-window attention takes queries in at most two equal runs of "
                "consecutive positions (context parallelism's layouts)"
            )

"""Attention sinks and sliding windows (gpt-oss's attention) and chunks (Llama 4's) against a
written-out reference: the scores of every query over its visible keys and the sink logit,
one softmax, the sink's column dropped. Outputs and gradients (queries, keys, values, sinks)
agree on every path the module takes: eager CPU (per-document calls, the windowed blocks),
compiled (dense masks), and a context-parallel rank's queries over the whole sequence's keys."""

import itertools
import unittest.mock

import pytest
import torch

from torchtitan.distributed.context_parallel import sequence_order
from torchtitan.models.common import sliding_window
from torchtitan.models.common.attention import ScaledDotProductAttention

BS, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 48, 16


def _reference(q, k, v, documents, window, sinks, scale, chunk=None):
    """Every score written out: causal, within ``window``, the chunk and the document, then
    the sink."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None]
    visible = j <= i
    if window is not None:
        visible = visible & (j > i - window)
    if chunk is not None:
        visible = visible & (i // chunk == j // chunk)
    if documents is not None:
        visible = visible & (documents[:, None, :, None] == documents[:, None, None, :])
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return scores.softmax(-1) @ v
    sink_column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probabilities = torch.cat([scores, sink_column], -1).softmax(-1)
    return probabilities[..., :-1] @ v  # the sink's share dropped


def _inputs(seed: int, sink: bool):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BS, HEADS, SEQ, HEAD_DIM, generator=g, requires_grad=True)
    k, v = (torch.randn(BS, KV_HEADS, SEQ, HEAD_DIM, generator=g, requires_grad=True) for _ in "kv")
    sinks = torch.randn(HEADS, generator=g, requires_grad=True) if sink else None
    weights = torch.randn(BS, HEADS, SEQ, HEAD_DIM, generator=g)
    return q, k, v, sinks, weights


DOCUMENTS = torch.zeros(BS, SEQ, dtype=torch.long)
DOCUMENTS[0, 10:], DOCUMENTS[0, 30:], DOCUMENTS[1, 20:] = 1, 2, 1


# Compiled, the module takes one path for every case (a dense mask of the window, documents
# and sink): these cases turn each of them on and off. Each compiles forward and backward for
# two query lengths (the whole sequence, and CP 2's balanced halves: the mask is the same code
# at any positions), 10 s on a cold cache; all 16 took 3 minutes of the suite, and a third
# query length (CP 4) another 100 s of the suite's two busy cores.
COMPILED = {(None, False, True), (None, True, False), (10, True, True), (12, False, False)}


@pytest.mark.parametrize(
    "window, sink, block_causal",
    list(itertools.product((None, 8, 10, 12), (False, True), (False, True))),
)
def test_sinks_and_windows_equal_the_written_out_attention(window, sink, block_causal):
    q, k, v, sinks, weights = _inputs(seed=hash((window, sink, block_causal)) % 1000, sink=sink)
    inputs = [q, k, v] + ([sinks] if sink else [])
    documents = DOCUMENTS if block_causal else None
    want = _reference(q, k, v, documents, window, sinks, HEAD_DIM**-0.5)
    want_grads = torch.autograd.grad((want * weights).sum(), inputs)
    attention = ScaledDotProductAttention(window=window)
    runs = [attention]
    if (window, sink, block_causal) in COMPILED:
        torch._dynamo.reset()
        runs.append(torch.compile(attention, fullgraph=True, dynamic=False))
    for run in runs:
        out = run(q, k, v, documents, sinks=sinks)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad((out * weights).sum(), inputs)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        # Context parallelism: each rank's queries (load-balanced head and tail chunks, or one
        # run) over the whole sequence's keys; the ranks' gradients sum to the whole's.
        for cp, balanced in ((2, True), (4, False))[: 1 if run is not attention else 2]:
            loss = 0
            for positions in sequence_order(SEQ, cp, balanced).view(cp, -1):
                where = positions.expand(BS, -1)
                out = run(q[:, :, positions], k, v, documents, query_positions=where, sinks=sinks)
                torch.testing.assert_close(out, want[:, :, positions], rtol=1e-5, atol=1e-5)
                loss = loss + (out * weights[:, :, positions]).sum()
            for got, expected in zip(torch.autograd.grad(loss, inputs), want_grads, strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk, block_causal", [(16, False), (16, True), (20, True)])
def test_chunked_attention_equals_the_written_out_attention(chunk, block_causal):
    """Llama 4's chunked attention: a query sees only the keys of its chunk (and document),
    on the per-document CPU calls, compiled, and at a context-parallel rank's positions."""
    q, k, v, _, weights = _inputs(seed=chunk + block_causal, sink=False)
    documents = DOCUMENTS if block_causal else None
    want = _reference(q, k, v, documents, None, None, HEAD_DIM**-0.5, chunk=chunk)
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    attention = ScaledDotProductAttention(chunk=chunk)
    torch._dynamo.reset()
    for run in (attention, torch.compile(attention, fullgraph=True, dynamic=False)):
        out = run(q, k, v, documents)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        for positions in sequence_order(SEQ, 2, True).view(2, -1):
            where = positions.expand(BS, -1)
            out = run(q[:, :, positions], k, v, documents, query_positions=where)
            torch.testing.assert_close(out, want[:, :, positions], rtol=1e-5, atol=1e-5)


def test_a_sink_lets_a_head_attend_to_nothing():
    """A large sink logit takes the whole softmax: the output goes to zero; a very negative one
    leaves plain attention."""
    q, k, v, _, _ = _inputs(seed=1, sink=False)
    attention = ScaledDotProductAttention()
    plain = attention(q, k, v)
    with torch.no_grad():
        assert attention(q, k, v, sinks=torch.full((HEADS,), 50.0)).abs().max() < 1e-6
        gone = attention(q, k, v, sinks=torch.full((HEADS,), -50.0))
        torch.testing.assert_close(gone, plain, rtol=1e-5, atol=1e-6)


def test_a_window_covering_the_sequence_is_plain_causal_and_blocks_stay_small():
    """A window at least the sequence's length changes nothing (the plain path runs); a shorter
    one computes each block of queries over at most two windows of keys."""
    q, k, v, _, _ = _inputs(seed=2, sink=False)
    plain = ScaledDotProductAttention()(q, k, v)
    torch.testing.assert_close(ScaledDotProductAttention(window=SEQ)(q, k, v), plain)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    with unittest.mock.patch.object(sliding_window.F, "scaled_dot_product_attention", recording):
        ScaledDotProductAttention(window=8)(q, k, v)
    assert calls == [(BS * SEQ // 8, KV_HEADS, 8 + 8 - 1, HEAD_DIM)]


def test_queries_not_in_runs_of_consecutive_positions_are_refused():
    q, k, v, _, _ = _inputs(seed=3, sink=False)
    scattered = torch.arange(0, SEQ, 2).expand(BS, -1)
    with pytest.raises(ValueError, match="two equal runs of consecutive positions"):
        ScaledDotProductAttention(window=8)(q[:, :, ::2], k, v, query_positions=scattered)

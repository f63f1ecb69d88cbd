"""Which linear layers train in float8 (``--float8.filter_fqns`` and CUDA's 16-alignment)."""

from torch import nn

from torchtitan.components.float8 import wanted


def test_filter_keeps_named_and_unaligned_linears_in_high_precision():
    filters = ["output"]
    assert wanted(nn.Linear(256, 512), "layers.0.attention.wq", filter_fqns=filters)
    assert not wanted(nn.Linear(256, 2048), "output", filter_fqns=filters)
    assert not wanted(nn.Linear(256, 8), "layers.1.moe.router.gate", filter_fqns=filters)
    assert not wanted(nn.Linear(24, 256), "layers.0.feed_forward.w2", filter_fqns=filters)
    assert not wanted(nn.Embedding(10, 16), "tok_embeddings", filter_fqns=filters)

import dataclasses
import math

import pytest
import torch

from torchtitan.models.llama3 import flavors
from torchtitan.models.llama3.args import Llama3Args, RopeScaling
from torchtitan.models.llama3.model import Attention, Transformer, apply_rope, precompute_rope_cis

# Published parameter counts of the Llama 3.1 / 3.2 checkpoints.
PUBLISHED = {
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}


def _meta_params(args: Llama3Args) -> int:
    with torch.device("meta"):
        model = Transformer(args)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_flavor_param_counts_match_published(flavor):
    assert _meta_params(flavors[flavor]) == PUBLISHED[flavor]
    assert flavors[flavor].num_params() == PUBLISHED[flavor]


def test_debugmodel_dims():
    a = flavors["debugmodel"]
    assert (a.dim, a.n_layers, a.n_heads, a.vocab_size, a.rope_theta) == (
        256,
        6,
        16,
        2048,
        500000.0,
    )
    assert _meta_params(a) == a.num_params() == 5_770_496


def test_ffn_dim_rule():
    # 8B: 4096 -> int(2*16384/3)=10922 -> *1.3=14198 -> round up to 1024 -> 14336
    assert flavors["8B"].ffn_hidden_dim == 14336
    assert flavors["70B"].ffn_hidden_dim == 28672
    assert flavors["405B"].ffn_hidden_dim == 53248


def _tiny(**kw) -> Llama3Args:
    base = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=97, max_seq_len=32)
    return Llama3Args(**(base | kw))


def _built(args: Llama3Args, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def test_rope_table_shape_and_unit_magnitude():
    cis = precompute_rope_cis(head_dim=16, max_seq_len=10, theta=500000.0, scaling=None)
    assert cis.shape == (10, 8) and cis.dtype == torch.complex64
    torch.testing.assert_close(cis.abs(), torch.ones(10, 8))
    # Position 0 is the identity rotation; position 1 turns pair 0 by exactly 1 radian.
    torch.testing.assert_close(cis[0], torch.ones(8, dtype=torch.complex64))
    assert math.isclose(torch.angle(cis[1, 0]).item(), 1.0, rel_tol=1e-6)


def test_rope_llama31_scaling_keeps_high_and_divides_low_frequencies():
    s = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    plain = torch.angle(precompute_rope_cis(128, 2, 500000.0, None)[1]).double()
    scaled = torch.angle(precompute_rope_cis(128, 2, 500000.0, s)[1]).double()
    freqs = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    wavelen = 2 * math.pi / freqs
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(scaled[high], plain[high], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(scaled[low], freqs[low] / 8, rtol=1e-4, atol=1e-9)
    mid = ~high & ~low
    assert torch.all(scaled[mid] < freqs[mid]) and torch.all(scaled[mid] > freqs[mid] / 8)


def test_apply_rope_preserves_norm_and_relative_positions():
    torch.manual_seed(0)
    cis = precompute_rope_cis(16, 8, 10000.0, None)
    q = torch.randn(1, 8, 2, 16)
    k = torch.randn(1, 8, 1, 16)
    rq, rk = apply_rope(q, k, cis)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # The same q/k vector at every position: q_i . k_j depends only on i - j.
    q_same = q[:, :1].expand(1, 8, 2, 16).contiguous()
    k_same = k[:, :1].expand(1, 8, 1, 16).contiguous()
    rq, rk = apply_rope(q_same, k_same, cis)
    dots = torch.einsum("bihd,bjhd->bhij", rq[:, :, :1], rk)
    torch.testing.assert_close(dots[0, 0, 3, 1], dots[0, 0, 5, 3], rtol=1e-5, atol=1e-5)


def test_gqa_shapes_and_equivalence_to_repeated_kv_heads():
    args = _tiny()
    torch.manual_seed(0)
    attn = Attention(args)
    assert attn.wq.weight.shape == (64, 64)
    assert attn.wk.weight.shape == (2 * 8, 64) and attn.wv.weight.shape == (2 * 8, 64)
    x = torch.randn(3, 5, 64)
    cis = precompute_rope_cis(args.head_dim, 16, args.rope_theta, None)
    out = attn(x, cis)
    assert out.shape == (3, 5, 64)
    # Same attention with K/V weights repeated to 8 heads (plain multi-head) gives the same output.
    mha = Attention(dataclasses.replace(args, n_kv_heads=8))
    with torch.no_grad():
        mha.wq.weight.copy_(attn.wq.weight)
        mha.wo.weight.copy_(attn.wo.weight)
        for src, dst in ((attn.wk, mha.wk), (attn.wv, mha.wv)):
            heads = src.weight.view(2, 8, 64).repeat_interleave(4, dim=0)
            dst.weight.copy_(heads.reshape(64, 64))
    torch.testing.assert_close(mha(x, cis), out, rtol=1e-5, atol=1e-5)


def test_forward_shape_and_causality():
    model = _built(_tiny())
    tokens = torch.randint(0, 97, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, 97)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 97
    torch.testing.assert_close(model(changed)[:, :8], logits[:, :8])
    assert not torch.allclose(model(changed)[:, 8:], logits[:, 8:])


def test_init_on_meta_then_device_is_deterministic_and_complete():
    a, b = _built(_tiny(), seed=3), _built(_tiny(), seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.isfinite(p).all(), name
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    c = _built(_tiny(), seed=4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    # Output projections of deeper blocks start smaller (depth-scaled init).
    std0 = a.layers["0"].attention.wo.weight.std()
    std1 = a.layers["1"].attention.wo.weight.std()
    assert std1 < std0


def test_weight_tying_shares_one_matrix():
    model = _built(_tiny(tie_word_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert (
        _meta_params(_tiny(tie_word_embeddings=True))
        == _tiny(tie_word_embeddings=True).num_params()
    )
    assert _tiny().num_params() - _tiny(tie_word_embeddings=True).num_params() == 97 * 64
    # Logits start O(1) so the initial loss is near ln(vocab).
    loss = torch.nn.functional.cross_entropy(
        model(torch.randint(0, 97, (4, 16))).flatten(0, 1), torch.randint(0, 97, (64,))
    )
    assert abs(loss.item() - math.log(97)) < 1.0


def test_flops_per_token_is_6n_plus_attention():
    a = flavors["8B"]
    n = a.num_params(exclude_embedding=True)
    assert a.flops_per_token(8192) == 6 * n + 12 * 32 * 32 * 128 * 8192

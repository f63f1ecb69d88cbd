"""Qwen3 hyper-parameters and the published flavors, dense and with experts. No torch import
here.

Qwen3 is Llama 3's decoder with three differences: each query and key head is RMS-normalized
before the rotary embedding (``qk_norm``), the head width is set on its own (128 in every
published size, so ``n_heads x head_dim`` differs from ``dim`` in most), and the FFN width is
given, not derived. The rest (GQA, SwiGLU, RMSNorm, RoPE without scaling) is Llama's. The MoE
sizes (Qwen3-30B-A3B, Qwen3-235B-A22B) put a mixture of 128 experts in every block in place of
the SwiGLU: softmax routing to 8, their weights renormalized to sum to 1, no shared expert.
"""

import dataclasses

from torchtitan.models.common.moe_args import MoEArgs
from torchtitan.models.llama3.args import Llama3Args


@dataclasses.dataclass(frozen=True)
class Qwen3Args(Llama3Args):
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True
    max_seq_len: int = 40960
    """RoPE table length (the published ``max_position_embeddings``); runs set it to
    ``--training.seq_len``."""
    head_size: int | None = 128
    hidden_dim: int | None = 3072
    """(Unused by the flavors with experts in every block, kept as published.)"""


# Qwen3's routing (every MoE size): softmax over the experts, top 8, renormalized.
_QWEN3_MOE = MoEArgs(
    num_experts=128, num_shared_experts=0, top_k=8, score_func="softmax", route_norm=True
)

# The published shapes (the Hugging Face config.json of Qwen/Qwen3-<size>); counts in
# tests/unit_tests/models/test_qwen3.py, checked against transformers' Qwen3ForCausalLM and
# Qwen3MoeForCausalLM.
flavors: dict[str, Qwen3Args] = {
    # Not a published size: small enough for a CPU with the bundled 2048-token tokenizer; its
    # heads (8 x 64) are wider than the model (256), as the published sizes' are.
    "debugmodel": Qwen3Args(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        head_size=64,
        hidden_dim=768,
        vocab_size=2048,
    ),  # fmt: skip
    "0.6B": Qwen3Args(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_word_embeddings=True
    ),
    "1.7B": Qwen3Args(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_word_embeddings=True
    ),
    "4B": Qwen3Args(
        dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_word_embeddings=True
    ),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
    # Not a published size: Qwen3's MoE block (softmax routing, no shared expert) on the debug
    # model's attention, 8 experts of width 256, top 2: a CPU trains it in minutes.
    "debugmodel_moe": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_size=64,
        hidden_dim=768,
        vocab_size=2048,
        moe_hidden_dim=256,
        moe=MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax"),
    ),  # fmt: skip
    "30B-A3B": Qwen3Args(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        hidden_dim=6144,
        moe=_QWEN3_MOE,
        moe_hidden_dim=768,
    ),  # fmt: skip
    "235B-A22B": Qwen3Args(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        hidden_dim=12288,
        moe=_QWEN3_MOE,
        moe_hidden_dim=1536,
    ),  # fmt: skip
}

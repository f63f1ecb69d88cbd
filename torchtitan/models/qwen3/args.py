"""Qwen3 (dense) hyper-parameters and the published flavors. No torch import here.

Qwen3 is Llama 3's decoder with three differences: each query and key head is RMS-normalized
before the rotary embedding (``qk_norm``), the head width is set on its own (128 in every
published size, so ``n_heads x head_dim`` differs from ``dim`` in most), and the FFN width is
given, not derived. The rest (GQA, SwiGLU, RMSNorm, RoPE without scaling) is Llama's.
"""

import dataclasses

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
    head_size: int = 128
    """Each head's width (``head_dim``)."""
    hidden_dim: int = 3072
    """The SwiGLU hidden width (``ffn_hidden_dim``, HF's ``intermediate_size``)."""

    @property
    def head_dim(self) -> int:
        return self.head_size

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim


# The published shapes (the Hugging Face config.json of Qwen/Qwen3-<size>); counts in
# tests/unit_tests/models/test_qwen3.py, checked against transformers' Qwen3ForCausalLM.
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
}

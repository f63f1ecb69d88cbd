"""gpt-oss hyper-parameters and the published flavors. No torch import here.

gpt-oss is a decoder of Llama 3's shape (pre-norm RMSNorm blocks, grouped-query attention,
RoPE, untied output) with a mixture of experts in every block and four differences in
attention and the experts:

- attention: biases on the query, key, value and output projections; a learned sink logit per
  query head in every softmax (a head may attend to nothing); every other block (the 1st, 3rd,
  ...) sees only the 128 latest tokens, the others the whole causal sequence; YaRN-scaled RoPE
  (theta 150,000, factor 32 over an original 4,096 tokens, not truncated);
- experts: a router with a bias, softmax over the top 4 experts' logits (the same as softmax
  over all, renormalized over the top 4), no shared expert; each expert's projections have
  biases and its gate is a clamped SwiGLU, ``(up + 1) * gate * sigmoid(1.702 * gate)`` with
  ``gate <= 7`` and ``|up| <= 7``.

The head width is given (64), so ``n_heads x head_dim`` (4,096) differs from ``dim`` (2,880).
"""

import dataclasses

from torchtitan.models.common.moe_args import MoEArgs
from torchtitan.models.llama3.args import Llama3Args, YarnScaling

# As published (the Hugging Face config.json of openai/gpt-oss-20b / -120b).
_ROPE = YarnScaling(
    factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
    truncate=False,
)  # fmt: skip


def _routing(num_experts: int, top_k: int = 4) -> MoEArgs:
    return MoEArgs(
        num_experts=num_experts, num_shared_experts=0, top_k=top_k, score_func="softmax",
        route_norm=True, router_bias=True, expert_linear_bias=True, activation="clamped_swiglu",
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GptOssArgs(Llama3Args):
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: YarnScaling | None = _ROPE
    max_seq_len: int = 131072
    """RoPE table length (the published ``max_position_embeddings``); runs set it to
    ``--training.seq_len``."""
    head_size: int | None = 64
    hidden_dim: int | None = 2880
    """(No dense FFN: every block has experts; HF's ``intermediate_size`` is an expert's
    width, ``moe_hidden_dim``.)"""
    attention_bias: bool = True
    attention_sinks: bool = True
    sliding_window: int = 128
    full_attention_every: int = 2
    moe: MoEArgs | None = dataclasses.field(default_factory=lambda: _routing(32))
    moe_hidden_dim: int = 2880


flavors: dict[str, GptOssArgs] = {
    # Not a published size: gpt-oss's blocks at a CPU's scale with the bundled 2048-token
    # tokenizer (8 experts of width 256, top 2; a 32-token window, so that the windowed
    # blocks differ from the others at the debug runs' sequence lengths).
    "debugmodel": GptOssArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_size=64,
        vocab_size=2048,
        sliding_window=32,
        moe=_routing(8, top_k=2),
        moe_hidden_dim=256,
    ),  # fmt: skip
    "20b": GptOssArgs(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, moe=_routing(32)),
    "120b": GptOssArgs(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, moe=_routing(128)),
}

"""Llama 4 hyper-parameters and the published flavors (their text model). No torch import
here.

Llama 4 is Llama 3's decoder with mixtures of experts and interleaved attention (iRoPE):

- every 4th block attends without RoPE over the whole causal sequence and scales its queries
  by position (``1 + 0.1 log(1 + floor((p + 1) / 8192))``: sharper far into long contexts);
  the others rotate, attend only within chunks of 8,192 tokens, and (Scout) RMS-normalize
  their rotated queries and keys without a weight;
- experts: a router picks one expert per token by the sigmoid of its logit, and scales the
  token by that score on its way into the expert (not the expert's output); one shared
  SwiGLU expert every token goes through. Scout has experts (16) in every block, Maverick
  (128) in every 2nd, the others a dense SwiGLU twice an expert's width.

Heads are 128 wide; RoPE theta 500,000, Scout with Llama 3.1's frequency scaling (factor 16
over 8,192 tokens). The vision encoder of the published models is not here: this is the text
model (``Llama4ForCausalLM``), which the published folders hold under ``language_model.``.
"""

import dataclasses

from torchtitan.models.common.moe_args import MoEArgs
from torchtitan.models.llama3.args import Llama3Args, RopeScaling


def _routing(num_experts: int) -> MoEArgs:
    return MoEArgs(
        num_experts=num_experts, num_shared_experts=1, top_k=1, score_func="sigmoid",
        route_norm=False, score_before_experts=True,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Llama4Args(Llama3Args):
    vocab_size: int = 202048
    rope_theta: float = 500000.0
    max_seq_len: int = 10485760
    """RoPE table length (Scout's ``max_position_embeddings``); runs set it to
    ``--training.seq_len``."""
    head_size: int | None = 128
    hidden_dim: int | None = 16384
    """The dense blocks' SwiGLU width (HF's ``intermediate_size_mlp``)."""
    moe: MoEArgs | None = dataclasses.field(default_factory=lambda: _routing(16))
    moe_hidden_dim: int = 8192
    nope_every: int = 4
    attention_chunk: int = 8192
    qk_l2_norm: bool = True
    nope_temperature: tuple[float, float] | None = (8192.0, 0.1)


flavors: dict[str, Llama4Args] = {
    # Not a published size: Maverick's interleaving (experts in every 2nd block) with Scout's
    # attention at a CPU's scale, with the bundled 2048-token tokenizer; chunks of 32 tokens
    # and a query temperature that grows from position 15, so that both act at the debug
    # runs' sequence lengths.
    "debugmodel": Llama4Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_size=32,
        vocab_size=2048,
        hidden_dim=512,
        moe=_routing(8),
        moe_hidden_dim=256,
        moe_every=2,
        attention_chunk=32,
        nope_temperature=(16.0, 0.1),
        rope_scaling=None,
    ),  # fmt: skip
    # As published (the text_config of meta-llama/Llama-4-Scout-17B-16E and
    # -Maverick-17B-128E); a folder whose fields differ is refused naming them.
    "17bx16e": Llama4Args(
        dim=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        moe=_routing(16),
        rope_scaling=RopeScaling(
            factor=16.0,
            low_freq_factor=1.0,
            high_freq_factor=1.0,
            original_max_position_embeddings=8192,
        ),
    ),  # fmt: skip
    "17bx128e": Llama4Args(
        dim=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        moe=_routing(128),
        moe_every=2,
        qk_l2_norm=False,
        max_seq_len=1048576,
    ),  # fmt: skip
}

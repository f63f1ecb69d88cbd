"""DeepSeek-V3 hyper-parameters and the published flavors. No torch import here."""

import dataclasses

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.moe_args import MoEArgs, check_moe_degrees


@dataclasses.dataclass(frozen=True)
class DeepSeekV3Args:
    vocab_size: int = 129280
    dim: int = 7168
    inter_dim: int = 18432
    """Hidden width of the dense blocks' SwiGLU."""
    moe_inter_dim: int = 2048
    """Hidden width of one expert (routed or shared)."""
    n_layers: int = 61
    n_dense_layers: int = 3
    """The first blocks have a dense SwiGLU; the rest a mixture of experts."""
    n_heads: int = 128
    moe: MoEArgs = MoEArgs()
    # Multi-head latent attention: queries and keys/values pass through low-rank bottlenecks;
    # each head's query/key is a part without position (nope) and a RoPE part shared by heads.
    q_lora_rank: int = 1536
    """Rank of the query bottleneck; 0 projects queries directly."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    norm_eps: float = 1e-6
    # RoPE with YaRN frequency scaling beyond ``original_seq_len``.
    rope_theta: float = 10000.0
    original_seq_len: int = 4096
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0
    max_seq_len: int = 4096
    """RoPE table length; the trainer sets it to ``--training.seq_len``."""

    def with_depth(self, n_layers: int) -> "DeepSeekV3Args":
        """A shallow copy for the dry run's memory probes, which extrapolate from 1 and 2
        identical blocks: MoE blocks only (per token a dense block's SwiGLU and an MoE
        block's experts are about as wide: 18432 vs 8 x 2048 + 2048 for 671B); parameter
        bytes are counted exactly on the full model."""
        return dataclasses.replace(self, n_layers=n_layers, n_dense_layers=0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def _attention_params(self) -> int:
        h = self.n_heads
        if self.q_lora_rank:
            q = (
                self.dim * self.q_lora_rank
                + self.q_lora_rank
                + self.q_lora_rank * h * self.qk_head_dim
            )
        else:
            q = self.dim * h * self.qk_head_dim
        kv = (
            self.dim * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        )
        return q + kv + h * self.v_head_dim * self.dim

    def _moe_params(self, experts: int) -> int:
        m = self.moe
        expert = 3 * self.dim * self.moe_inter_dim
        return self.dim * m.num_experts + experts * expert + m.num_shared_experts * expert

    def num_params(self, *, activated: bool = False) -> int:
        """Exact parameter count of the built module; ``activated``: those one token's
        compute uses (``top_k`` routed experts per MoE layer, no embedding table), the
        convention of the published "activated" figures."""
        block = self._attention_params() + 2 * self.dim
        dense = 3 * self.dim * self.inter_dim
        moe = self._moe_params(self.moe.top_k if activated else self.moe.num_experts)
        embedding = 0 if activated else self.vocab_size * self.dim
        return (
            self.n_layers * block
            + self.n_dense_layers * dense
            + self.n_moe_layers * moe
            + embedding
            + self.vocab_size * self.dim  # output projection
            + self.dim  # final norm
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x activated parameters + attention scores and values
        (6 x layers x heads x seq x (qk head dim + v head dim))."""
        attention = (
            6 * self.n_layers * self.n_heads * seq_len * (self.qk_head_dim + self.v_head_dim)
        )
        return 6 * self.num_params(activated=True) + attention


def check_parallel_degrees(
    args: DeepSeekV3Args,
    *,
    flavor: str,
    tp: int,
    ep: int,
    sequence_parallel: bool,
    seq_len: int,
    cp: int = 1,
) -> None:
    """Reject tensor- and expert-parallel degrees that cannot split this flavor evenly
    (``seq_len``: the whole sequence, of which each context-parallel rank holds ``seq_len /
    cp``)."""
    flag = f"--parallelism.tensor_parallel_degree={tp}"
    dims = {
        "n_heads": args.n_heads,
        "the dense FFN hidden size": args.inter_dim,
        "vocab_size": args.vocab_size,
    }
    for name, value in dims.items():
        if value and value % tp:
            raise ConfigError(f"{flag} does not divide {name}={value} of flavor {flavor}")
    check_moe_degrees(args.moe, args.moe_inter_dim, flavor=flavor, tp=tp, ep=ep)
    if tp > 1 and sequence_parallel and (seq_len // cp) % tp:
        share = f" / context_parallel_degree {cp}" if cp > 1 else ""
        raise ConfigError(
            f"{flag} does not divide --training.seq_len={seq_len}{share} (sequence parallelism "
            "splits the sequence); change either, or pass --parallelism.no_enable_sequence_parallel"
        )


flavors: dict[str, DeepSeekV3Args] = {
    # Not a published size: small enough to train on a laptop CPU with the bundled tokenizer.
    "debugmodel": DeepSeekV3Args(
        vocab_size=2048,
        dim=256,
        inter_dim=768,
        moe_inter_dim=256,
        n_layers=4,
        n_dense_layers=1,
        n_heads=8,
        moe=MoEArgs(num_experts=8, num_shared_experts=1, top_k=2, score_func="sigmoid"),
        q_lora_rank=0,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
    ),
    # DeepSeek-V2-Lite's shapes (15.7B total, 2.4B activated).
    "16B": DeepSeekV3Args(
        vocab_size=102400,
        dim=2048,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        moe=MoEArgs(
            num_experts=64,
            num_shared_experts=2,
            top_k=6,
            score_func="softmax",
            route_norm=False,
        ),
        q_lora_rank=0,
        kv_lora_rank=512,
        mscale=0.707,
    ),
    # DeepSeek-V3 (671B total, 37B activated; without the multi-token-prediction module).
    "671B": DeepSeekV3Args(
        moe=MoEArgs(
            num_experts=256,
            num_shared_experts=1,
            top_k=8,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_groups=8,
            top_groups=4,
        ),
    ),
}

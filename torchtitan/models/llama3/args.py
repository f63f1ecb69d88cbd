"""Llama 3 hyper-parameters and the published flavors. No torch import here."""

import dataclasses

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.moe_args import MoEArgs, check_moe_degrees


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency scaling of RoPE (long-context extension)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN scaling of RoPE (gpt-oss; transformers' ``rope_type: yarn``): frequencies whose
    wavelength fits ``original_max_position_embeddings`` fewer than ``beta_slow`` times are
    divided by ``factor``, those fitting more than ``beta_fast`` times kept, a linear ramp
    between (over the dims, floored and ceiled with ``truncate``); the rotations are scaled
    by ``attention_factor`` (default ``0.1 ln(factor) + 1``), so each query-key product by
    its square."""

    factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclasses.dataclass(frozen=True)
class Llama3Args:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None`` means ``n_heads``."""
    vocab_size: int = 128256
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    max_seq_len: int = 131072
    """RoPE table length; the trainer sets it to ``--training.seq_len``."""
    tie_word_embeddings: bool = False
    depth_init: bool = True
    """Scale each block's output-projection init by its depth instead of the layer count."""
    qk_norm: bool = False
    """RMSNorm each query and key head (over its dims, one weight shared by the heads) before
    the rotary embedding, as Qwen3 does."""
    moe: MoEArgs | None = None
    """A mixture of experts in every block in place of the dense SwiGLU (Qwen3's MoE sizes);
    ``None``: dense."""
    moe_hidden_dim: int = 0
    """Hidden width of one expert (HF's ``moe_intermediate_size``), with ``moe``."""
    attention_bias: bool = False
    """Biases on the query, key, value and output projections (gpt-oss)."""
    attention_sinks: bool = False
    """A learned logit per query head in every row's softmax that adds nothing to the output
    (gpt-oss): a head may attend to nothing (``models.common.attention.with_sink``)."""
    sliding_window: int = 0
    """With ``> 0`` a block's attention sees only this many latest tokens (itself included),
    except every ``full_attention_every``-th block's (gpt-oss: 128, every 2nd)."""
    full_attention_every: int = 2
    moe_every: int = 1
    """With ``moe``: every ``moe_every``-th block (the n-th, 2n-th, ...) has experts, the
    others the dense SwiGLU of ``ffn_hidden_dim`` (Llama 4 Maverick: 2)."""
    nope_every: int = 0
    """With ``> 0`` every ``nope_every``-th block (the n-th, 2n-th, ...) attends without
    RoPE, over the whole causal sequence (Llama 4's iRoPE: 4); the others rotate, and with
    ``attention_chunk`` see only their chunk."""
    attention_chunk: int = 0
    """With ``> 0`` the blocks with RoPE attend only within chunks of this many tokens, the
    window cut at multiples of it (Llama 4: 8,192)."""
    qk_l2_norm: bool = False
    """The blocks with RoPE RMS-normalize each query and key head after the rotation, without
    a weight (Llama 4 Scout)."""
    nope_temperature: tuple[float, float] | None = None
    """``(floor_scale, attn_scale)``: the blocks without RoPE scale each query at position
    ``p`` by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` (Llama 4:
    ``(8192, 0.1)``), sharpening attention far into long sequences."""

    def window(self, layer_id: int) -> int | None:
        """Block ``layer_id``'s sliding window (``None``: the whole causal sequence)."""
        if self.sliding_window <= 0 or (layer_id + 1) % self.full_attention_every == 0:
            return None
        return self.sliding_window

    def with_depth(self, n_layers: int) -> "Llama3Args":
        """A shallow copy for the dry run's memory probes, which extrapolate from 1 and 2
        identical blocks: with dense and expert blocks interleaved (``moe_every > 1``), expert
        blocks only (Llama 4 Maverick: a dense block's SwiGLU is as wide as an expert block's
        activated experts). Else the probes are a dense block and then an expert one, and
        the expert block's gathered weights, which the last FSDP unit keeps after forward,
        count as every block's activations (Maverick under EP 8 on 256 ranks: 186.6 GiB
        instead of 14.1)."""
        return dataclasses.replace(self, n_layers=n_layers, moe_every=1)

    def has_experts(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` has the mixture of experts (else the dense SwiGLU)."""
        return self.moe is not None and (layer_id + 1) % self.moe_every == 0

    def uses_rope(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` rotates its queries and keys (``nope_every``)."""
        return self.nope_every <= 0 or (layer_id + 1) % self.nope_every != 0

    head_size: int | None = None
    """Each head's width when given on its own (Qwen3, gpt-oss, Llama 4); ``None``:
    ``dim / n_heads``."""
    hidden_dim: int | None = None
    """The dense SwiGLU's width when given (HF's ``intermediate_size``); ``None``: Llama's
    rule from ``dim`` (``ffn_hidden_dim``)."""

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """``hidden_dim``, else Llama's rule: 2/3 of 4*dim, times the multiplier, rounded up
        to ``multiple_of``."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def ffn_params(self, *, activated: bool, layer_id: int | None = None) -> int:
        """One block's SwiGLU, or its mixture of experts (router, routed experts: ``top_k``
        of them when ``activated``, shared experts). ``layer_id`` ``None``: the mean over
        the blocks (they differ with ``moe_every``)."""
        if layer_id is None:
            total = sum(
                self.ffn_params(activated=activated, layer_id=i) for i in range(self.n_layers)
            )
            return total // self.n_layers
        if not self.has_experts(layer_id):
            return 3 * self.dim * self.ffn_hidden_dim
        m = self.moe
        expert = 3 * self.dim * self.moe_hidden_dim
        routed = m.top_k if activated else m.num_experts
        router = (self.dim + m.router_bias) * m.num_experts
        biases = routed * (2 * self.moe_hidden_dim + self.dim) * m.expert_linear_bias
        return router + (routed + m.num_shared_experts) * expert + biases

    def num_params(self, *, exclude_embedding: bool = False, activated: bool = False) -> int:
        """Exact parameter count, computed from the dims (matches the built module);
        ``activated``: the routed experts a token uses (``top_k`` per block), not all."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.dim * q_dim * 2 + self.dim * kv_dim * 2 + 2 * self.head_dim * self.qk_norm
        attn += (q_dim + 2 * kv_dim + self.dim) * self.attention_bias
        attn += self.n_heads * self.attention_sinks
        ffn = sum(self.ffn_params(activated=activated, layer_id=i) for i in range(self.n_layers))
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        total = self.n_layers * (attn + 2 * self.dim) + ffn + self.dim + embedding + output
        return total - embedding if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x (non-embedding params a token activates) + attention
        (12 * L * H * D * S, with S the keys a block's window holds where it has one)."""
        dense = 6 * self.num_params(exclude_embedding=True, activated=True)
        if self.tie_word_embeddings:
            # The tied output projection is still a matmul per token.
            dense += 6 * self.vocab_size * self.dim
        keys = sum(min(seq_len, self.window(i) or self.attention_chunk_of(i) or seq_len)
                   for i in range(self.n_layers))  # fmt: skip
        attention = 12 * self.n_heads * self.head_dim * keys
        return dense + attention

    def attention_chunk_of(self, layer_id: int) -> int | None:
        """Block ``layer_id``'s attention chunk (``None``: none)."""
        if self.attention_chunk <= 0 or not self.uses_rope(layer_id):
            return None
        return self.attention_chunk


def check_parallel_degrees(
    args: Llama3Args,
    *,
    flavor: str,
    tp: int,
    sequence_parallel: bool,
    seq_len: int,
    cp: int = 1,
    ep: int = 1,
) -> None:
    """Reject tensor- and expert-parallel degrees that cannot split this flavor evenly
    (``seq_len``: the whole sequence, of which each context-parallel rank holds ``seq_len /
    cp``)."""
    flag = f"--parallelism.tensor_parallel_degree={tp}"
    dims = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "vocab_size": args.vocab_size,
    }
    if not all(args.has_experts(i) for i in range(args.n_layers)):  # dense blocks
        dims["the FFN hidden size"] = args.ffn_hidden_dim
    for name, value in dims.items():
        if value % tp:
            raise ConfigError(f"{flag} does not divide {name}={value} of flavor {flavor}")
    if args.moe is not None:
        check_moe_degrees(args.moe, args.moe_hidden_dim, flavor=flavor, tp=tp, ep=ep)
    if tp > 1 and sequence_parallel and (seq_len // cp) % tp:
        share = f" / context_parallel_degree {cp}" if cp > 1 else ""
        raise ConfigError(
            f"{flag} does not divide --training.seq_len={seq_len}{share} (sequence parallelism "
            "splits the sequence); change either, or pass --parallelism.no_enable_sequence_parallel"
        )


_LLAMA31_ROPE = RopeScaling(factor=8.0)
_LLAMA32_ROPE = RopeScaling(factor=32.0)

flavors: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, rope_theta=500000.0
    ),
    # Not a published size: a ~100M model on the bundled tokenizer, for CPU benchmarks.
    "debug_100m": Llama3Args(
        dim=768, n_layers=16, n_heads=12, n_kv_heads=4, vocab_size=2048, rope_theta=500000.0
    ),
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=_LLAMA32_ROPE,
        tie_word_embeddings=True,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=_LLAMA32_ROPE,
        tie_word_embeddings=True,
    ),
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=_LLAMA31_ROPE,
    ),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=_LLAMA31_ROPE,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_scaling=_LLAMA31_ROPE,
    ),
}
# Not a published size: 8B's shapes with 4 of its 32 blocks, which fits one 80 GB GPU with its
# optimizer state (benchmarks/bench_gpu.py).
flavors["8B_4layers"] = dataclasses.replace(flavors["8B"], n_layers=4)

"""DeepSeek-V3 as plain ``nn.Module``s: multi-head latent attention, dense then
mixture-of-experts blocks. No parallel code here (plans live in ``parallelize.py``).

Shapes: ``bs`` batch, ``seq`` sequence, ``dim`` model width, ``h`` heads.
"""

import math

import torch
from torch import nn

from torchtitan.models.common.attention import ScaledDotProductAttention, attention_documents
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import apply_rope
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args


def precompute_yarn_cis(args: DeepSeekV3Args) -> torch.Tensor:
    """Complex rotations ``[max_seq_len, qk_rope_head_dim // 2]``. Beyond the pretraining
    length (``original_seq_len``), YaRN: low frequencies are divided by ``rope_factor``,
    high ones kept, with a linear ramp between the dims that turn ``beta_slow`` and
    ``beta_fast`` times over the original length."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if args.max_seq_len > args.original_seq_len:
        low, high = _yarn_ramp_dims(args)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(
            0, 1
        )
        # ramp 0: fast-turning dims, kept; ramp 1: slow ones, interpolated by the factor.
        freqs = freqs * (1 - ramp) + freqs / args.rope_factor * ramp
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def _yarn_ramp_dims(args: DeepSeekV3Args) -> tuple[float, float]:
    """The pair-dims index range over which YaRN blends kept and scaled frequencies."""
    dim, base, length = args.qk_rope_head_dim, args.rope_theta, args.original_seq_len

    def turning_dim(turns: float) -> float:  # the dim whose rotation turns `turns` times
        return dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(turning_dim(args.beta_fast)), 0)
    high = min(math.ceil(turning_dim(args.beta_slow)), dim - 1)
    return low, high


def softmax_scale(args: DeepSeekV3Args) -> float:
    """``1 / sqrt(qk head dim)``, times YaRN's attention temperature squared when the RoPE
    table is stretched beyond the pretraining length."""
    scale = args.qk_head_dim**-0.5
    if args.max_seq_len > args.original_seq_len:
        m = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
        scale *= m * m
    return scale


class MultiHeadLatentAttention(nn.Module):
    """Queries (directly or through a rank-``q_lora_rank`` bottleneck) and keys/values through
    a shared rank-``kv_lora_rank`` latent; every head's key carries one RoPE part computed
    once from the input and shared by all heads."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.args = args
        h = args.n_heads
        if args.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, h * args.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, h * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.wo = nn.Linear(h * args.v_head_dim, args.dim, bias=False)
        self.sdpa = ScaledDotProductAttention(scale=softmax_scale(args))
        # The RoPE part of the keys, computed once and shared by every head: a module of its
        # own so a tensor-parallel plan can sum its gradient over the ranks splitting heads.
        self.shared_key = nn.Identity()

    def forward(
        self, x: torch.Tensor, rope_cis: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        a = self.args
        bs, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 instead of the head count so a tensor-parallel plan can shard heads.
        q = q.view(bs, seq, -1, a.qk_head_dim)
        q_nope, q_rope = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = apply_rope(q_rope, self.shared_key(k_rope).unsqueeze(2), rope_cis)
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seq, -1, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        heads = q.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        out = self.sdpa(*(t.transpose(1, 2) for t in (q, k, v)), documents)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))

    def init_weights(self, init_std: float) -> None:
        linears = [self.wkv_a, self.wkv_b]
        linears += [self.wq] if self.wq is not None else [self.wq_a, self.wq_b]
        for linear in linears:
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.kv_norm.reset_parameters()
        if self.wq is None:
            self.q_norm.reset_parameters()


class TransformerBlock(nn.Module):
    """Attention then a dense SwiGLU (``feed_forward``, the first ``n_dense_layers`` blocks)
    or a mixture of experts (``moe``)."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MultiHeadLatentAttention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe_inter_dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(
        self, x: torch.Tensor, rope_cis: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cis, documents)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.init_std)


class Transformer(nn.Module):
    """Token ids ``[bs, seq]`` -> logits ``[bs, seq, vocab]``; built on the meta device and
    initialised with ``init_weights`` after ``to_empty``, like Llama 3's."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cis", precompute_yarn_cis(args), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and buffer in place (after ``to_empty``)."""
        with torch.device(buffer_device or self.rope_cis.device):
            self.rope_cis = precompute_yarn_cis(self.args)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As Llama 3's ``forward``: ``tokens`` (or a later pipeline stage's hidden states),
        optional ``positions [bs, seq]`` and ``document_ids [bs, seq]``."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_cis if positions is None else self.rope_cis[positions]
        documents = attention_documents(document_ids, positions)
        for layer in self.layers.values():
            h = layer(h, rope, documents)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

"""Llama 3 as plain ``nn.Module``s: no parallel code here (plans live in ``parallelize.py``).

Shapes: ``bs`` batch, ``seq`` sequence, ``dim`` model width, ``h`` heads, ``hd`` head dim.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.common.attention import ScaledDotProductAttention, attention_documents
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import apply_rope
from torchtitan.models.llama3.args import Llama3Args, RopeScaling, YarnScaling


def precompute_rope_cis(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | YarnScaling | None
) -> torch.Tensor:
    """Complex rotations ``[max_seq_len, head_dim // 2]`` with Llama 3.1 frequency scaling or
    YaRN (whose rotations also scale by its attention factor)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    magnitude = 1.0
    if isinstance(scaling, YarnScaling):
        freqs = _yarn_frequencies(freqs, scaling, theta, head_dim)
        magnitude = scaling.attention_factor or 0.1 * math.log(scaling.factor) + 1.0
    elif scaling is not None:
        freqs = _scale_rope_frequencies(freqs, scaling)
    positions = torch.arange(max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.full_like(angles, magnitude), angles).to(torch.complex64)


def _yarn_frequencies(
    freqs: torch.Tensor, s: YarnScaling, theta: float, head_dim: int
) -> torch.Tensor:
    """YaRN: interpolate (divide by ``factor``) the frequencies that turn fewer than
    ``beta_slow`` times over the original context, keep those that turn more than
    ``beta_fast`` times, ramp linearly over the dims between (transformers' rule)."""

    def turning_dim(turns: float) -> float:  # the dim whose rotation turns `turns` times
        wavelength = s.original_max_position_embeddings / (turns * 2 * math.pi)
        return head_dim * math.log(wavelength) / (2 * math.log(theta))

    low, high = turning_dim(s.beta_fast), turning_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / s.factor * ramp + freqs * (1 - ramp)


def _scale_rope_frequencies(freqs: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Divide low frequencies by ``factor``, keep high ones, interpolate smoothly between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / s.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, freqs)
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, interpolated, scaled)


class Attention(nn.Module):
    """Causal grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` K/V heads
    (with ``qk_norm``, each query and key head RMS-normalized before the rotary embedding;
    with ``attention_sinks``, a learned sink logit per query head). Block ``layer_id``'s
    may see only a window of the latest tokens (``args.window``), or skip RoPE
    (``args.uses_rope``): then with ``nope_temperature`` it scales its queries by position;
    else with ``attention_chunk`` it sees only its chunk, and with ``qk_l2_norm`` it
    normalizes its rotated queries and keys."""

    def __init__(self, args: Llama3Args, layer_id: int = 0):
        super().__init__()
        self.rope = args.uses_rope(layer_id)
        self.l2_norm_eps = args.norm_eps if args.qk_l2_norm and self.rope else None
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=bias)
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if args.attention_sinks else None
        chunk = args.attention_chunk if self.rope and args.attention_chunk > 0 else None
        self.sdpa = ScaledDotProductAttention(window=args.window(layer_id), chunk=chunk)

    def forward(
        self,
        x: torch.Tensor,
        rope_cis: torch.Tensor,
        documents: torch.Tensor | None = None,
        *,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``documents``: ``None`` for causal attention, else each token's document number
        (block-causal). ``q_scale``: the queries' temperature by position, applied by a block
        without RoPE, as ``rope_cis``: a table ``[>= seq]`` or each token's own ``[bs, seq]``
        (the sequence this attention sees: whole under sequence parallelism)."""
        bs, seq, _ = x.shape
        # -1 instead of the head counts so a tensor-parallel plan can shard heads.
        xq = self.wq(x).view(bs, seq, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        if self.rope:
            xq, xk = apply_rope(xq, xk, rope_cis)
        if self.l2_norm_eps is not None:  # no weight, in float32
            xq, xk = (F.rms_norm(t.float(), (t.shape[-1],), eps=self.l2_norm_eps).type_as(t)
                      for t in (xq, xk))  # fmt: skip
        elif q_scale is not None and not self.rope:
            # The table [>= seq] (token i at position i), or each token's own [bs, seq].
            scale = (
                q_scale[:seq].view(1, seq, 1, 1) if q_scale.dim() == 1 else q_scale[..., None, None]
            )
            xq = (xq * scale).to(xq.dtype)
        sinks = self.sinks
        if isinstance(sinks, DTensor):  # tensor parallel: this rank's heads'
            sinks = sinks.to_local()
        # [bs, h, seq, hd] for SDPA.
        out = self.sdpa(*(t.transpose(1, 2) for t in (xq, xk, xv)), documents, sinks=sinks)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.sinks is not None:
            nn.init.trunc_normal_(self.sinks, mean=0.0, std=0.02)
        if self.q_norm is not None:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()


class TransformerBlock(nn.Module):
    """Attention then a SwiGLU (``feed_forward``), or with ``args.moe`` a mixture of experts
    (``moe``)."""

    def __init__(self, layer_id: int, args: Llama3Args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.has_experts(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe_hidden_dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.init_std = 0.02 / (2 * depth) ** 0.5

    def forward(
        self,
        x: torch.Tensor,
        rope_cis: torch.Tensor,
        documents: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cis, documents, q_scale=q_scale)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.init_std)


class Transformer(nn.Module):
    """Token ids ``[bs, seq]`` -> logits ``[bs, seq, vocab]``.

    Build it under ``torch.device("meta")`` and call ``init_weights`` after moving it to the
    target device (``to_empty``), so a 405B model never materialises on one host.
    """

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index keeps checkpoint names stable when a pipeline
        # stage deletes the layers it does not own.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cis", self._rope_cis(), persistent=False)

    def _rope_cis(self) -> torch.Tensor:
        a = self.args
        return precompute_rope_cis(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and buffer in place (after ``to_empty``)."""
        with torch.device(buffer_device or self.rope_cis.device):
            self.rope_cis = self._rope_cis()
        tied = self.args.tie_word_embeddings and None not in (self.output, self.tok_embeddings)
        if tied and self.output.weight is not self.tok_embeddings.weight:
            # to_empty() gives each module its own new Parameter: tie them again.
            self.output.weight = self.tok_embeddings.weight
        final_std = self.args.dim**-0.5
        if self.tok_embeddings is not None:
            if self.args.tie_word_embeddings:
                # The shared matrix is also the output projection; with a larger std a token's
                # own embedding dominates its logits (Llama 3.2 uses 0.02 for both).
                nn.init.trunc_normal_(self.tok_embeddings.weight, std=0.02)
            else:
                nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.args.tie_word_embeddings:
            cutoff = 3 * final_std
            nn.init.trunc_normal_(self.output.weight, std=final_std, a=-cutoff, b=cutoff)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` (or, on a later pipeline stage, the hidden states ``[bs, seq, dim]``);
        ``positions [bs, seq]`` gives each token's place in its sequence where it is not its
        column (context parallelism hands a rank a load-balanced, non-contiguous share);
        ``document_ids [bs, seq]`` makes attention block-causal: a token sees only the earlier
        tokens of its own document (with ``positions``, they cover the whole sequence: each
        block's attention then sees the whole sequence's keys, gathered by context
        parallelism)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope_cis if positions is None else self.rope_cis[positions]
        a = self.args
        # FlexAttention's block mask takes neither sinks, windows nor chunks (yet): blocks
        # whose window or chunk cuts the sequence take the document numbers on every device.
        masked = document_ids if a.attention_sinks else attention_documents(document_ids, positions)
        whole = document_ids.shape[1] if document_ids is not None else a.max_seq_len
        q_scale = None
        if a.nope_temperature is not None:  # like the RoPE table: by position, [seq_len]
            floor_scale, attn_scale = a.nope_temperature
            table = torch.arange(a.max_seq_len, device=h.device).float()
            q_scale = 1 + attn_scale * torch.log1p(torch.floor((table + 1) / floor_scale))
            q_scale = q_scale if positions is None else q_scale[positions]
        for i, layer in self.layers.items():
            cuts = [c for c in (a.window(int(i)), a.attention_chunk_of(int(i))) if c is not None]
            plain = any(c < whole for c in cuts)
            h = layer(h, rope, document_ids if plain else masked, q_scale)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

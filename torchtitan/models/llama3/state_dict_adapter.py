"""Llama 3 weights in Hugging Face ``transformers`` form (``LlamaForCausalLM``) and back.

Names: ``layers.{i}.attention.wq.weight`` <-> ``model.layers.{i}.self_attn.q_proj.weight`` and so
on (the table below). Layout: one difference, the rotary embedding. Ours rotates adjacent pairs
of a head's dims (``(0, 1), (2, 3), ...``, Meta's layout); ``transformers`` rotates dim ``j``
with dim ``j + head_dim / 2``. The query and key projections' output rows are permuted per head
accordingly; everything else is copied. Tied embeddings: a tied HF model has no ``lm_head``
(our untied output gets a copy of the embedding); we export as tied when our output equals the
embedding exactly (a tied flavor, or an untouched import), so HF -> ours -> HF is bit-identical.
"""

import re
from typing import Any

import torch

from torchtitan.components.hf_config import check_computation, hf_rope
from torchtitan.config.errors import ConfigError
from torchtitan.models.llama3.args import Llama3Args, RopeScaling

_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


class Llama3StateDictAdapter:
    """Converts one tensor at a time (full tensors, any dtype) for ``args``' shapes. The
    interface every family's adapter has (``components/checkpoint_hf.py`` calls it): HF names
    per parameter, ``to_hf`` / ``from_hf`` between one of our tensors and its HF tensors,
    ``hf_config`` and ``check_hf_config``."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    block_names: dict[str, str] = _BLOCK
    """Our names within a block -> HF's within ``model.layers.{i}``."""

    def __init__(self, args: Llama3Args):
        self.args = args

    def hf_names(self, name: str) -> list[str]:
        """The HF tensors of our parameter ``name`` (``KeyError``: HF has no place for it)."""
        if name in _TOP:
            return [_TOP[name]]
        match = _LAYER.fullmatch(name)
        if match is None or match.group(2) not in self.block_names:
            raise KeyError(name)
        return [f"model.layers.{match.group(1)}.{self.block_names[match.group(2)]}"]

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Our ``name``'s full tensor as HF tensors."""
        heads = self._rotary_heads(name)
        (hf,) = self.hf_names(name)
        return {hf: tensor if heads is None else _pairs_to_halves(tensor, heads)}

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """HF's tensors (by name) for our parameter ``name``, in our layout."""
        heads = self._rotary_heads(name)
        (tensor,) = tensors.values()
        return tensor if heads is None else _halves_to_pairs(tensor, heads)

    def source_names(self, name: str, available: set[str]) -> list[str]:
        """Which HF tensors fill our ``name``: its own, or for our output layer of a tied HF
        model (no ``lm_head``), the embedding."""
        names = self.hf_names(name)
        if names == ["lm_head.weight"] and "lm_head.weight" not in available:
            return ["model.embed_tokens.weight"]
        return names

    def _rotary_heads(self, name: str) -> int | None:
        if name.endswith("attention.wq.weight"):
            return self.args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.args.kv_heads
        return None

    def hf_config(self, *, tied: bool, dtype: torch.dtype, bos_id: int | None, eos_id: int | None):
        """``config.json`` for ``transformers``' ``architecture`` with these shapes."""
        a = self.args
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": tied,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if isinstance(a.rope_scaling, RopeScaling):  # (a family with YaRN writes its own)
            s = a.rope_scaling
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        config |= {
            k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None
        }
        return config

    def check_hf_config(self, config: dict[str, Any], where: str) -> None:
        """Refuse (one line) an HF model whose shapes differ from this flavor's."""
        a = self.args
        wanted = {
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "vocab_size": a.vocab_size,
        }
        if config.get("model_type") not in (None, self.model_type):
            raise ConfigError(
                f"{where}: model_type {config['model_type']!r} is not {self.model_type!r} "
                f"(--module picks the model family)"
            )
        found = {
            k: config.get(k, a.n_heads if k == "num_key_value_heads" else None) for k in wanted
        }
        wrong = [f"{k}={found[k]} (flavor: {v})" for k, v in wanted.items() if found[k] != v]
        if wrong:
            raise ConfigError(
                f"{where}: the HF model's {', '.join(wrong)} differ from this --model.flavor; "
                "pick the flavor with its shapes"
            )
        head_dim = config.get("head_dim") or a.dim // a.n_heads
        if head_dim != a.head_dim:
            raise ConfigError(
                f"{where}: head_dim {head_dim} differs from the flavor's {a.head_dim}"
            )
        # What changes the logits without changing a shape.
        check_computation(config, where, {
            "rms_norm_eps": a.norm_eps, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "use_sliding_window": False,
        })  # fmt: skip
        self._check_rope(config, where)

    def _check_rope(self, config: dict[str, Any], where: str) -> None:
        """The rotary embedding's base and scaling must be the flavor's: a folder edited for
        long context (YaRN, a longer Llama 3.1 table) would otherwise load and compute other
        logits. Reads both ``config.json`` forms (``rope_theta`` + ``rope_scaling``, and
        transformers 5's ``rope_parameters``)."""
        a = self.args
        theta, kind, scaling = hf_rope(config)
        if theta != a.rope_theta:
            raise ConfigError(
                f"{where}: rope_theta {theta} differs from the flavor's {a.rope_theta}"
            )
        ours = a.rope_scaling
        if ours is None:
            if kind != "default":
                raise ConfigError(
                    f"{where}: the HF model scales its rotary embedding ({kind}), this flavor "
                    "does not; pick a flavor with its rope scaling"
                )
            return
        wanted = {
            "rope_type": "llama3",
            "factor": ours.factor,
            "low_freq_factor": ours.low_freq_factor,
            "high_freq_factor": ours.high_freq_factor,
            "original_max_position_embeddings": ours.original_max_position_embeddings,
        }
        found = {k: scaling.get(k) for k in wanted} | {"rope_type": kind}
        wrong = [f"{k}={found[k]} (flavor: {v})" for k, v in wanted.items() if found[k] != v]
        if wrong:
            raise ConfigError(
                f"{where}: the HF model's rope scaling {', '.join(wrong)} differs from this "
                "--model.flavor's"
            )


def _pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from ``(0, 1), (2, 3), ...`` pairs to ``[evens, odds]`` halves."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`_pairs_to_halves`."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)

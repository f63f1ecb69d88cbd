"""gpt-oss weights in Hugging Face ``transformers`` form (``GptOssForCausalLM``) and back.

Llama 3's mapping (``models/llama3/state_dict_adapter.py``: names, the rotary permutation of
the query and key rows, here of their biases too) plus:

- ``layers.{i}.attention.sinks`` <-> ``self_attn.sinks``; the projections' biases by name;
- the router ``moe.router.gate.weight / bias`` <-> ``mlp.router.weight / bias``;
- the experts, ``[E, out, in]`` per projection here, are two tensors there, ``[E, in, out]``:
  ``mlp.experts.gate_up_proj [E, dim, 2 x hidden]`` holds the gate (our ``w1``) in its even
  columns and the up projection (``w3``) in its odd ones, its bias ``gate_up_proj_bias``
  likewise; ``down_proj [E, hidden, dim]`` is ``w2`` transposed, ``down_proj_bias`` is
  ``w2_bias``. An export hands ``w1`` and ``w3`` over as parts of one HF tensor
  (``hf_config.FusedPart``), assembled once in the export's dtype.

The published checkpoints store the experts' weights in mxfp4 (``gate_up_proj_blocks`` /
``_scales``), which the import reads dequantized (``components/hf_quantization.py``). The
balancing ``expert_bias`` has no place there: an export of a model whose bias moved is
refused.
"""

import re
from typing import Any

import torch

from torchtitan.components.hf_config import FusedPart, check_computation, hf_rope
from torchtitan.config.errors import ConfigError
from torchtitan.models.gpt_oss.args import GptOssArgs
from torchtitan.models.llama3.state_dict_adapter import (
    Llama3StateDictAdapter,
    _halves_to_pairs,
    _pairs_to_halves,
)

_ATTENTION = {
    f"attention.{ours}.{kind}": f"self_attn.{hf}_proj.{kind}"
    for ours, hf in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))
    for kind in ("weight", "bias")
}
_BLOCK = {
    **_ATTENTION,
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    "moe.experts.w1": "mlp.experts.gate_up_proj",
    "moe.experts.w3": "mlp.experts.gate_up_proj",
    "moe.experts.w1_bias": "mlp.experts.gate_up_proj_bias",
    "moe.experts.w3_bias": "mlp.experts.gate_up_proj_bias",
    "moe.experts.w2": "mlp.experts.down_proj",
    "moe.experts.w2_bias": "mlp.experts.down_proj_bias",
}
_PUBLISHED_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                   "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip
_GATE, _UP = ("w1", "w1_bias"), ("w3", "w3_bias")  # even, odd columns of gate_up_proj(_bias)
_ROTARY = re.compile(r".*attention\.w([qk])\.(weight|bias)")


class GptOssStateDictAdapter(Llama3StateDictAdapter):
    architecture = "GptOssForCausalLM"
    model_type = "gpt_oss"
    block_names = _BLOCK

    def __init__(self, args: GptOssArgs):
        super().__init__(args)

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        (hf,) = self.hf_names(name)
        leaf = name.rpartition(".")[2]
        if leaf in _GATE + _UP:  # the even (gate) or odd (up) columns of the fused tensor
            part = tensor.transpose(1, 2) if leaf in ("w1", "w3") else tensor
            return {hf: FusedPart(part, index=int(leaf in _UP), count=2, interleaved=True)}
        if leaf == "w2":
            return {hf: tensor.transpose(1, 2)}
        heads = self._rotary_heads(name)
        if heads is not None and name.endswith("bias"):
            return {hf: _pairs_to_halves(tensor.view(-1, 1), heads).view(-1)}
        return {hf: tensor if heads is None else _pairs_to_halves(tensor, heads)}

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        (tensor,) = tensors.values()
        leaf = name.rpartition(".")[2]
        if leaf in _GATE + _UP:
            part = tensor[..., 0 if leaf in _GATE else 1 :: 2]
            return part.transpose(1, 2) if leaf in ("w1", "w3") else part
        if leaf == "w2":
            return tensor.transpose(1, 2)
        heads = self._rotary_heads(name)
        if heads is not None and name.endswith("bias"):
            return _halves_to_pairs(tensor.view(-1, 1), heads).view(-1)
        return tensor if heads is None else _halves_to_pairs(tensor, heads)

    def _rotary_heads(self, name: str) -> int | None:
        match = _ROTARY.fullmatch(name)
        if match is None:
            return None
        return self.args.n_heads if match.group(1) == "q" else self.args.kv_heads

    def _fields(self) -> dict[str, Any]:
        """The HF config fields that must equal the flavor's (shapes and routing)."""
        a, m = self.args, self.args.moe
        return {
            "hidden_size": a.dim,
            "intermediate_size": a.moe_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "sliding_window": a.sliding_window,
            "layer_types": self._layer_types(),
        }

    def _layer_types(self) -> list[str]:
        windows = (self.args.window(i) for i in range(self.args.n_layers))
        return ["full_attention" if w is None else "sliding_attention" for w in windows]

    def _rope_fields(self) -> dict[str, Any]:
        s = self.args.rope_scaling
        return {
            "rope_type": "yarn",
            "factor": s.factor,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "truncate": s.truncate,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }

    def hf_config(self, *, tied: bool, dtype: torch.dtype, bos_id: int | None, eos_id: int | None):
        m = self.args.moe
        routing = {
            "score_func": (m.score_func, "softmax"),
            "route_norm": (m.route_norm, True),
            "route_scale": (m.route_scale, 1.0),
            "num_shared_experts": (m.num_shared_experts, 0),
            "num_groups": (m.num_groups, 1),
            "activation": (m.activation, "clamped_swiglu"),
            "swiglu_alpha": (m.swiglu_alpha, 1.702),
        }
        wrong = [f"{k}={v} (HF: {want})" for k, (v, want) in routing.items() if v != want]
        if wrong:
            raise ConfigError(
                f"GptOssForCausalLM routes by softmax over its top experts' logits, without "
                f"shared experts or scaling; this flavor's {', '.join(wrong)} has no HF equivalent"
            )
        config = super().hf_config(tied=tied, dtype=dtype, bos_id=bos_id, eos_id=eos_id)
        for field in ("mlp_bias", "rope_scaling"):
            config.pop(field, None)
        return config | self._fields() | {
            "attention_bias": True,
            "swiglu_limit": m.swiglu_limit,
            "rope_scaling": self._rope_fields(),
            "initial_context_length": self.args.rope_scaling.original_max_position_embeddings,
        }  # fmt: skip

    def check_hf_config(self, config: dict[str, Any], where: str) -> None:
        if config.get("model_type") not in (None, self.model_type):
            raise ConfigError(
                f"{where}: model_type {config['model_type']!r} is not {self.model_type!r} "
                f"(--module picks the model family)"
            )
        # transformers' defaults (GptOssConfig) for absent fields: heads of 64, a window of
        # 128 in every other block (the first sliding), the published YaRN.
        a = self.args
        found = dict(config)
        for field, default in (("head_dim", 64), ("sliding_window", 128)):
            if found.get(field) is None:
                found[field] = default
        if found.get("layer_types") is None:
            found["layer_types"] = [
                "full_attention" if (i + 1) % 2 == 0 else "sliding_attention"
                for i in range(config.get("num_hidden_layers", 0))
            ]
        wanted = self._fields()
        wrong = [
            f"{k}={found.get(k)} (flavor: {v})" for k, v in wanted.items() if found.get(k) != v
        ]
        if wrong:
            raise ConfigError(
                f"{where}: the HF model's {', '.join(wrong)} differ from this --model.flavor; "
                "pick the flavor with its shapes"
            )
        check_computation(config, where, {
            "rms_norm_eps": a.norm_eps, "attention_bias": True,
            "swiglu_limit": a.moe.swiglu_limit, "swiglu_alpha": a.moe.swiglu_alpha,
        })  # fmt: skip
        if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
            config = config | {"rope_parameters": {"rope_theta": 150000.0} | _PUBLISHED_ROPE}
        theta, kind, scaling = hf_rope(config)
        if theta != a.rope_theta:
            raise ConfigError(
                f"{where}: rope_theta {theta} differs from the flavor's {a.rope_theta}"
            )
        defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
        rope = {k: scaling.get(k, defaults.get(k)) for k in self._rope_fields()}
        rope["rope_type"] = kind
        wrong = [f"{k}={rope[k]} (flavor: {v})" for k, v in self._rope_fields().items()
                 if rope[k] != v]  # fmt: skip
        if wrong:
            raise ConfigError(
                f"{where}: the HF model's rope scaling {', '.join(wrong)} differs from this "
                "--model.flavor's"
            )

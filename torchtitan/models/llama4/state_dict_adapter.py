"""Llama 4 text weights in Hugging Face ``transformers`` form (``Llama4ForCausalLM``) and
back; also read from the published multimodal folders (``Llama4ForConditionalGeneration``,
``model_type`` llama4), whose text model sits under ``language_model.`` and whose shapes are
in ``config.json``'s ``text_config`` (the vision encoder is not read).

Names: Llama 3's for attention, norms, embedding and output; a dense block's SwiGLU is
``feed_forward.{gate,up,down}_proj`` there as here; a block with experts has
``feed_forward.router.weight`` (our ``moe.router.gate.weight``), the shared expert
``feed_forward.shared_expert.{gate,up,down}_proj.weight`` (``moe.shared_experts.w1/w3/w2``) and
the routed experts in two tensors, ``[E, in, out]``: ``feed_forward.experts.gate_up_proj
[E, dim, 2 x hidden]`` holds the gate (our ``w1``) in its first half of columns and the up
projection (``w3``) in its second, ``down_proj [E, hidden, dim]`` is ``w2`` transposed.
Layout: ``transformers``' Llama 4 rotates adjacent pairs of a head's dims, as ours does: no
permutation. The balancing ``expert_bias`` has no place there (an export of a model whose bias
moved is refused).
"""

import re
from typing import Any

import torch

from torchtitan.components.hf_config import FusedPart, check_computation
from torchtitan.config.errors import ConfigError
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.llama4.args import Llama4Args

_ATTENTION = {f"attention.w{ours}.weight": f"self_attn.{hf}_proj.weight"
              for ours, hf in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"))}  # fmt: skip
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_BLOCK = {
    **_ATTENTION,
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"feed_forward.{ours}.weight": f"feed_forward.{hf}.weight" for ours, hf in _SWIGLU.items()},
    **{
        f"moe.shared_experts.{ours}.weight": f"feed_forward.shared_expert.{hf}.weight"
        for ours, hf in _SWIGLU.items()
    },  # fmt: skip
    "moe.router.gate.weight": "feed_forward.router.weight",
    "moe.experts.w1": "feed_forward.experts.gate_up_proj",
    "moe.experts.w3": "feed_forward.experts.gate_up_proj",
    "moe.experts.w2": "feed_forward.experts.down_proj",
}
_MULTIMODAL = "language_model."  # the text model's prefix in the published folders
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


class Llama4StateDictAdapter(Llama3StateDictAdapter):
    architecture = "Llama4ForCausalLM"
    model_type = "llama4_text"
    model_types = ("llama4_text", "llama4")
    """Text-only folders, and the published multimodal ones (their text model)."""
    block_names = _BLOCK

    def __init__(self, args: Llama4Args):
        super().__init__(args)

    def hf_names(self, name: str) -> list[str]:
        match = _LAYER.fullmatch(name)
        if match is not None:  # a block's own FFN kind only
            moe = self.args.has_experts(int(match.group(1)))
            if match.group(2).startswith("moe." if not moe else "feed_forward."):
                raise KeyError(name)
        return super().hf_names(name)

    def source_names(self, name: str, available: set[str]) -> list[str]:
        if any(n.startswith(_MULTIMODAL) for n in available):  # a published multimodal folder
            text = {n.removeprefix(_MULTIMODAL) for n in available if n.startswith(_MULTIMODAL)}
            return [_MULTIMODAL + n for n in super().source_names(name, text)]
        return super().source_names(name, available)

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        (hf,) = self.hf_names(name)
        leaf = name.rpartition(".")[2]
        if ".moe.experts." in name and leaf in ("w1", "w3"):  # its half of gate_up_proj
            return {hf: FusedPart(tensor.transpose(1, 2), index=int(leaf == "w3"), count=2)}
        if ".moe.experts." in name:  # w2
            return {hf: tensor.transpose(1, 2)}
        return {hf: tensor}

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        (tensor,) = tensors.values()
        leaf = name.rpartition(".")[2]
        if ".moe.experts." in name and leaf in ("w1", "w3"):
            gate, up = tensor.chunk(2, dim=-1)
            return (gate if leaf == "w1" else up).transpose(1, 2)
        if ".moe.experts." in name:
            return tensor.transpose(1, 2)
        return tensor

    def _fields(self) -> dict[str, Any]:
        """The HF config fields that must equal the flavor's (shapes, routing, attention)."""
        a, m = self.args, self.args.moe
        return {
            "hidden_size": a.dim,
            "intermediate_size": a.moe_hidden_dim,
            "intermediate_size_mlp": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "moe_layers": [i for i in range(a.n_layers) if a.has_experts(i)],
            "no_rope_layers": [int(a.uses_rope(i)) for i in range(a.n_layers)],
            "attention_chunk_size": a.attention_chunk or None,
            "use_qk_norm": a.qk_l2_norm,
            "attn_temperature_tuning": a.nope_temperature is not None,
        }

    def hf_config(self, *, tied: bool, dtype: torch.dtype, bos_id: int | None, eos_id: int | None):
        m = self.args.moe
        routing = {
            "score_func": (m.score_func, "sigmoid"),
            "route_norm": (m.route_norm, False),
            "route_scale": (m.route_scale, 1.0),
            "num_shared_experts": (m.num_shared_experts, 1),
            "num_groups": (m.num_groups, 1),
            "score_before_experts": (m.score_before_experts, True),
            "activation": (m.activation, "silu"),
        }
        wrong = [f"{k}={v} (HF: {want})" for k, (v, want) in routing.items() if v != want]
        if wrong:
            raise ConfigError(
                "Llama4ForCausalLM routes by the sigmoid of each token's top logits, scaling "
                f"the token on its way in, with one shared expert; this flavor's "
                f"{', '.join(wrong)} has no HF equivalent"
            )
        config = super().hf_config(tied=tied, dtype=dtype, bos_id=bos_id, eos_id=eos_id)
        config.pop("mlp_bias")
        config |= self._fields()
        if self.args.nope_temperature is not None:
            floor_scale, attn_scale = self.args.nope_temperature
            config |= {"floor_scale": int(floor_scale), "attn_scale": attn_scale}
        return config

    def check_hf_config(self, config: dict[str, Any], where: str) -> None:
        if config.get("model_type") == "llama4":  # the published multimodal folders
            config = config.get("text_config") or {}
        if config.get("model_type") not in (None, "llama4_text"):
            raise ConfigError(
                f"{where}: model_type {config['model_type']!r} is not 'llama4_text' or "
                "'llama4' (--module picks the model family)"
            )
        # transformers' defaults for absent fields (Llama4TextConfig: Scout's).
        a = self.args
        layers = config.get("num_hidden_layers", 48)
        step = config.get("interleave_moe_layer_step") or 1
        interval = config.get("no_rope_layer_interval") or 4
        defaults = {
            "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8,
            "vocab_size": 202048, "num_hidden_layers": 48,
            "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_local_experts": 16, "num_experts_per_tok": 1,
            "moe_layers": list(range(step - 1, layers, step)),
            "no_rope_layers": [int((i + 1) % interval != 0) for i in range(layers)],
            "attention_chunk_size": 8192, "use_qk_norm": True, "attn_temperature_tuning": True,
        }  # fmt: skip
        # Absent, null or (a list) empty: the default, as transformers reads them.
        found = {k: config[k] if config.get(k) not in (None, []) else defaults.get(k)
                 for k in self._fields()}  # fmt: skip
        if "attention_chunk_size" in config and config["attention_chunk_size"] is None:
            found["attention_chunk_size"] = None
        # Published Instruct configs write the temperature switch as a number (4): truthy.
        found["attn_temperature_tuning"] = bool(found["attn_temperature_tuning"])
        wanted = self._fields()
        wrong = [f"{k}={found[k]} (flavor: {v})" for k, v in wanted.items() if found[k] != v]
        if wrong:
            raise ConfigError(
                f"{where}: the HF model's {', '.join(wrong)} differ from this --model.flavor; "
                "pick the flavor with its shapes"
            )
        if a.nope_temperature is not None:
            temperature = (config.get("floor_scale", 8192), config.get("attn_scale", 0.1))
            if tuple(map(float, temperature)) != a.nope_temperature:
                raise ConfigError(
                    f"{where}: the HF model's floor_scale, attn_scale {temperature} differ from "
                    f"the flavor's {a.nope_temperature}"
                )
        check_computation(config, where, {
            "rms_norm_eps": a.norm_eps, "hidden_act": "silu", "attention_bias": False,
        })  # fmt: skip
        self._check_rope(config | {"rope_theta": config.get("rope_theta", 500000.0)}, where)

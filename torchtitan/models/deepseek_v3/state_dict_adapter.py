"""DeepSeek-V3 weights in Hugging Face ``transformers`` form (``DeepseekV3ForCausalLM``, the
layout of the published checkpoints) and back.

Names: the table below. Layout: the routed experts, one ``[E, out, in]`` tensor each for
``w1`` / ``w2`` / ``w3`` here, are ``E`` tensors per projection there
(``mlp.experts.{j}.gate_proj/down_proj/up_proj.weight``); the expert bias that steers routing
is ``mlp.gate.e_score_correction_bias``. The rotary parts need no permutation: HF's DeepSeek-V3
rotates interleaved pairs (``rope_interleave``) as we do. Only sigmoid routing exists there.
"""

import re
from typing import Any

import torch

from torchtitan.components.hf_config import check_computation, hf_rope
from torchtitan.config.errors import ConfigError
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args

_ATTENTION = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")


class DeepSeekV3StateDictAdapter:
    """Converts one of our tensors at a time (full tensors); see ``models/llama3``'s adapter
    for the interface."""

    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    keep_in_fp32 = ("mlp.gate.e_score_correction_bias", "mlp.gate.weight")
    """HF names exported in float32 whatever the export dtype (``transformers`` keeps them so:
    the router's scores and bias pick the experts)."""

    def __init__(self, args: DeepSeekV3Args):
        self.args = args

    def hf_names(self, name: str) -> list[str]:
        if name in _TOP:
            return [_TOP[name]]
        match = _BLOCK.fullmatch(name)
        if match is None:
            raise KeyError(name)
        prefix, rest = f"model.layers.{match.group(1)}", match.group(2)
        parts = rest.split(".")
        if rest == "attention_norm.weight":
            return [f"{prefix}.input_layernorm.weight"]
        if rest == "ffn_norm.weight":
            return [f"{prefix}.post_attention_layernorm.weight"]
        if parts[0] == "attention" and len(parts) == 3 and parts[1] in _ATTENTION:
            return [f"{prefix}.self_attn.{_ATTENTION[parts[1]]}.weight"]
        if parts[0] == "feed_forward" and len(parts) == 3 and parts[1] in _SWIGLU:
            return [f"{prefix}.mlp.{_SWIGLU[parts[1]]}.weight"]
        if rest == "moe.router.gate.weight":
            return [f"{prefix}.mlp.gate.weight"]
        if rest == "moe.expert_bias":
            return [f"{prefix}.mlp.gate.e_score_correction_bias"]
        if parts[:2] == ["moe", "shared_experts"] and len(parts) == 4 and parts[2] in _SWIGLU:
            return [f"{prefix}.mlp.shared_experts.{_SWIGLU[parts[2]]}.weight"]
        if parts[:2] == ["moe", "experts"] and len(parts) == 3 and parts[2] in _SWIGLU:
            projection = _SWIGLU[parts[2]]
            return [
                f"{prefix}.mlp.experts.{j}.{projection}.weight"
                for j in range(self.args.moe.num_experts)
            ]
        raise KeyError(name)

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        names = self.hf_names(name)
        if len(names) == 1:
            return {names[0]: tensor}
        return dict(zip(names, tensor.unbind(0), strict=True))  # one tensor per expert

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if len(tensors) == 1:
            (tensor,) = tensors.values()
            return tensor
        return torch.stack([tensors[n] for n in self.hf_names(name)])

    def source_names(self, name: str, available: set[str]) -> list[str]:
        return self.hf_names(name)

    def _fields(self) -> dict[str, Any]:
        """The HF config fields that must equal the flavor's: shapes and routing rules."""
        a, m = self.args, self.args.moe
        return {
            "vocab_size": a.vocab_size,
            "hidden_size": a.dim,
            "intermediate_size": a.inter_dim,
            "moe_intermediate_size": a.moe_inter_dim,
            "num_hidden_layers": a.n_layers,
            "first_k_dense_replace": a.n_dense_layers,
            "num_attention_heads": a.n_heads,
            "n_routed_experts": m.num_experts,
            "n_shared_experts": m.num_shared_experts,
            "num_experts_per_tok": m.top_k,
            "n_group": m.num_groups,
            "topk_group": m.top_groups,
            "norm_topk_prob": m.route_norm,
            "routed_scaling_factor": m.route_scale,
            "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
        }

    def hf_config(self, *, tied: bool, dtype: torch.dtype, bos_id: int | None, eos_id: int | None):
        """``config.json`` for ``transformers``' ``DeepseekV3ForCausalLM``."""
        a, m = self.args, self.args.moe
        if m.score_func != "sigmoid":
            raise ConfigError(
                "Hugging Face's DeepSeek-V3 routes with sigmoid scores only; this flavor uses "
                f"{m.score_func}"
            )
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            **self._fields(),
            "num_key_value_heads": a.n_heads,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_interleave": True,
            "max_position_embeddings": a.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": tied,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if a.max_seq_len > a.original_seq_len:  # our YaRN table is on
            config["rope_scaling"] = {"rope_type": "yarn", **self._yarn_fields()}
        config |= {
            k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id)) if v is not None
        }
        return config

    def check_hf_config(self, config: dict[str, Any], where: str) -> None:
        """Refuse (one line) an HF model whose shapes or routing differ from this flavor's."""
        if config.get("model_type") not in (None, self.model_type):
            raise ConfigError(f"{where}: model_type {config['model_type']!r} is not DeepSeek-V3")
        wanted = self._fields()
        wrong = [
            f"{k}={config.get(k)} (flavor: {v})" for k, v in wanted.items() if config.get(k) != v
        ]
        if config.get("rope_interleave", True) is not True:
            wrong.append("rope_interleave=False (ours rotates interleaved pairs)")
        if wrong:
            raise ConfigError(
                f"{where}: the HF model's {', '.join(wrong)} differ from this --model.flavor; "
                "pick the flavor with its shapes"
            )
        if self.args.moe.score_func != "sigmoid":
            raise ConfigError(
                f"{where}: this --model.flavor routes with {self.args.moe.score_func} scores; "
                "Hugging Face's DeepSeek-V3 routes with sigmoid scores only"
            )
        check_computation(config, where, {
            "rms_norm_eps": self.args.norm_eps, "hidden_act": "silu", "attention_bias": False,
        })  # fmt: skip
        self._check_rope(config, where)

    def _yarn_fields(self) -> dict[str, Any]:
        """Our YaRN settings under HF's ``rope_scaling`` names."""
        a = self.args
        return {
            "factor": a.rope_factor,
            "original_max_position_embeddings": a.original_seq_len,
            "beta_fast": a.beta_fast,
            "beta_slow": a.beta_slow,
            "mscale": a.mscale,
            "mscale_all_dim": a.mscale,
        }

    def _check_rope(self, config: dict[str, Any], where: str) -> None:
        """The rotary base, and YaRN: ours scales beyond ``original_seq_len`` only, that is
        when the run's ``--training.seq_len`` is longer; the HF model scales whenever its
        ``config.json`` says so. Both must agree, with the same YaRN settings."""
        a = self.args
        theta, kind, scaling = hf_rope(config)
        if theta != a.rope_theta:
            raise ConfigError(
                f"{where}: rope_theta {theta} differs from the flavor's {a.rope_theta}"
            )
        ours = a.max_seq_len > a.original_seq_len
        if kind not in ("default", "yarn"):
            raise ConfigError(f"{where}: the HF model scales its rotary embedding ({kind}); ours "
                              "knows YaRN only")  # fmt: skip
        if (kind == "yarn") != ours:
            raise ConfigError(
                f"{where}: the HF model {'scales' if kind == 'yarn' else 'does not scale'} its "
                f"rotary embedding (YaRN); ours does {'not ' if not ours else ''}at "
                f"--training.seq_len {a.max_seq_len} (it scales beyond the flavor's "
                f"original_seq_len {a.original_seq_len}): "
                + ("train longer sequences" if not ours else "train sequences of at most "
                   f"{a.original_seq_len}")
            )  # fmt: skip
        if kind == "yarn":
            wanted = self._yarn_fields()
            wrong = [
                f"{k}={scaling.get(k)} (flavor: {v})"
                for k, v in wanted.items()
                if scaling.get(k) is not None and scaling.get(k) != v
            ]
            if wrong:
                raise ConfigError(
                    f"{where}: the HF model's YaRN {', '.join(wrong)} differs from this "
                    "--model.flavor's"
                )

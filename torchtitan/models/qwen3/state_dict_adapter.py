"""Qwen3 weights in Hugging Face ``transformers`` form (``Qwen3ForCausalLM``, and
``Qwen3MoeForCausalLM`` for the flavors with experts) and back.

Llama 3's mapping (``models/llama3/state_dict_adapter.py``) plus the two per-head norms,
``layers.{i}.attention.q_norm / k_norm.weight`` <-> ``self_attn.q_norm / k_norm.weight``. Their
weight runs over a head's dims, which the rotary layout orders differently on the two sides
(ours adjacent pairs, ``transformers`` halves), so it is permuted like one row of ``wq``.

With experts: the router ``moe.router.gate.weight`` <-> ``mlp.gate.weight``, and the routed
experts, one ``[E, out, in]`` tensor each for ``w1`` / ``w2`` / ``w3`` here, are ``E`` tensors
per projection there (``mlp.experts.{j}.gate_proj/down_proj/up_proj.weight``, the published
checkpoints' layout). Qwen3's MoE has no shared experts and no routing bias: an export of a
model whose ``expert_bias`` moved (``--moe.load_balance_coeff``) is refused.
"""

import re
from typing import Any

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.models.llama3.state_dict_adapter import (
    Llama3StateDictAdapter,
    _halves_to_pairs,
    _pairs_to_halves,
)
from torchtitan.models.qwen3.args import Qwen3Args

_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight",
          "attention.k_norm.weight": "self_attn.k_norm.weight"}  # fmt: skip
_EXPERTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


class Qwen3StateDictAdapter(Llama3StateDictAdapter):
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    model_types = ("qwen3", "qwen3_moe")
    """The ``model_type`` values of the family's HF folders (dense, with experts)."""
    block_names = Llama3StateDictAdapter.block_names | _NORMS

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        if args.moe is not None:
            self.architecture, self.model_type = "Qwen3MoeForCausalLM", "qwen3_moe"

    def hf_names(self, name: str) -> list[str]:
        match = _LAYER.fullmatch(name)
        if match is None or self.args.moe is None:
            return super().hf_names(name)
        mlp, rest = f"model.layers.{match.group(1)}.mlp", match.group(2)
        if rest.startswith("feed_forward."):  # a block with experts has no dense SwiGLU
            raise KeyError(name)
        if rest == "moe.router.gate.weight":
            return [f"{mlp}.gate.weight"]
        parts = rest.split(".")
        if parts[:2] == ["moe", "experts"] and len(parts) == 3 and parts[2] in _EXPERTS:
            projection = _EXPERTS[parts[2]]
            return [
                f"{mlp}.experts.{j}.{projection}.weight" for j in range(self.args.moe.num_experts)
            ]
        if rest.startswith("moe."):  # shared experts, the routing bias: no place there
            raise KeyError(name)
        return super().hf_names(name)

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if name.endswith(tuple(_NORMS)):
            (hf,) = self.hf_names(name)
            return {hf: _pairs_to_halves(tensor.view(-1, 1), 1).view(-1)}
        if ".moe.experts." in name:  # one tensor per expert
            return dict(zip(self.hf_names(name), tensor.unbind(0), strict=True))
        return super().to_hf(name, tensor)

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if name.endswith(tuple(_NORMS)):
            (tensor,) = tensors.values()
            return _halves_to_pairs(tensor.view(-1, 1), 1).view(-1)
        if ".moe.experts." in name:
            return torch.stack([tensors[n] for n in self.hf_names(name)])
        return super().from_hf(name, tensors)

    def _moe_fields(self) -> dict[str, Any]:
        """The HF config fields of the experts that must equal the flavor's."""
        a, m = self.args, self.args.moe
        return {
            "moe_intermediate_size": a.moe_hidden_dim,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "norm_topk_prob": m.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }

    def hf_config(self, **kwargs) -> dict[str, Any]:
        config = super().hf_config(**kwargs)
        config.pop("mlp_bias")  # Qwen3Config has no such field
        m = self.args.moe
        if m is None:
            return config
        routing = {
            "score_func": (m.score_func, "softmax"),
            "route_scale": (m.route_scale, 1.0),
            "num_shared_experts": (m.num_shared_experts, 0),
            "num_groups": (m.num_groups, 1),
        }
        wrong = [f"{k}={v} (HF: {want})" for k, (v, want) in routing.items() if v != want]
        if wrong:
            raise ConfigError(
                f"Qwen3MoeForCausalLM routes by softmax over every expert, without shared "
                f"experts or scaling; this flavor's {', '.join(wrong)} has no HF equivalent"
            )
        # (router_aux_loss_coef stays transformers' default: Qwen's loss is not ours.)
        return config | self._moe_fields()

    def check_hf_config(self, config: dict[str, Any], where: str) -> None:
        super().check_hf_config(config, where)
        if self.args.moe is None:
            return
        # transformers' defaults for absent (or null) fields; transformers 5 writes the
        # published num_experts as num_local_experts.
        defaults = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
                    "num_experts": config.get("num_local_experts")}  # fmt: skip
        wanted = self._moe_fields()
        found = {k: defaults.get(k) if config.get(k) is None else config[k] for k in wanted}
        wrong = [f"{k}={found[k]} (flavor: {v})" for k, v in wanted.items() if found[k] != v]
        if wrong:
            raise ConfigError(
                f"{where}: the HF model's {', '.join(wrong)} differ from this --model.flavor; "
                "pick the flavor with its shapes"
            )

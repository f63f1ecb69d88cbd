"""Qwen3 weights in Hugging Face ``transformers`` form (``Qwen3ForCausalLM``) and back.

Llama 3's mapping (``models/llama3/state_dict_adapter.py``) plus the two per-head norms,
``layers.{i}.attention.q_norm / k_norm.weight`` <-> ``self_attn.q_norm / k_norm.weight``. Their
weight runs over a head's dims, which the rotary layout orders differently on the two sides
(ours adjacent pairs, ``transformers`` halves), so it is permuted like one row of ``wq``.
"""

from typing import Any

import torch

from torchtitan.models.llama3.state_dict_adapter import (
    Llama3StateDictAdapter,
    _halves_to_pairs,
    _pairs_to_halves,
)

_NORMS = {"attention.q_norm.weight": "self_attn.q_norm.weight",
          "attention.k_norm.weight": "self_attn.k_norm.weight"}  # fmt: skip


class Qwen3StateDictAdapter(Llama3StateDictAdapter):
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    block_names = Llama3StateDictAdapter.block_names | _NORMS

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not name.endswith(tuple(_NORMS)):
            return super().to_hf(name, tensor)
        (hf,) = self.hf_names(name)
        return {hf: _pairs_to_halves(tensor.view(-1, 1), 1).view(-1)}

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if not name.endswith(tuple(_NORMS)):
            return super().from_hf(name, tensors)
        (tensor,) = tensors.values()
        return _halves_to_pairs(tensor.view(-1, 1), 1).view(-1)

    def hf_config(self, **kwargs) -> dict[str, Any]:
        config = super().hf_config(**kwargs)
        config.pop("mlp_bias")  # Qwen3Config has no such field
        return config

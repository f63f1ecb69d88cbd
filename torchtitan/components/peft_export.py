"""LoRA adapters in the PEFT library's format, next to a Hugging Face export: a folder with
``adapter_config.json`` and ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained``
loads onto the base HF model (and vLLM serves as a LoRA), so the fine-tune ships in a few MB
without the frozen weights.

Tensor names are PEFT's: ``base_model.model.<HF module>.lora_A.weight`` (``[r, in]``) and
``lora_B.weight`` (``[out, r]``). Our adapters live in our layout: B's rows take the HF
layout of their layer's weight rows (the query and key projections' rotary permutation), A's
columns need none, since every family's conversion of a linear layer moves rows only (checked
per layer: an adapter whose layer converts otherwise is refused). The scale ``alpha / r`` is
PEFT's default (no rsLoRA), the targets are the HF modules' full names (exactly the adapted
layers), dropout 0.
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from torchtitan.config.errors import ConfigError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


class PeftAdapters:
    """The adapters of one rank's model parts, in PEFT names (full tensors, on the host)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.targets: list[str] = []
        self.ranks_alphas: set[tuple[int, float]] = set()
        self.problems: list[str] = []
        """Adapters with no PEFT form (recorded, not raised: every rank must hear of them)."""

    def add(self, adapter: Any, name: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """The adapter ``a`` ``[r, in]``, ``b`` ``[out, r]`` of our layer weight ``name``
        (full tensors), whose output is scaled by ``scale``."""
        converted = adapter.to_hf(name, b)
        if len(converted) != 1:
            self.problems.append(f"{name}: its HF tensors are split, PEFT adapters cannot follow")
            return
        ((hf_name, b_hf),) = converted.items()
        # Rows only: converting B·A must equal converting B, then multiplying by A.
        whole = adapter.to_hf(name, b.double() @ a.double())[hf_name]
        if not torch.allclose(whole, b_hf.double() @ a.double(), rtol=1e-6, atol=1e-9):
            self.problems.append(
                f"{name}: its conversion to {hf_name} moves columns, so its LoRA adapter has "
                "no PEFT form"
            )
            return
        module = hf_name.removesuffix(".weight")
        self.tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().cpu()
        self.tensors[f"base_model.model.{module}.lora_B.weight"] = b_hf.detach().cpu()
        self.targets.append(module)
        rank = a.shape[0]
        self.ranks_alphas.add((rank, round(scale * rank, 6)))


def write_peft(
    folder: Path, parts: list[PeftAdapters], *, dtype: torch.dtype, base_model: str | None
) -> int:
    """Write every rank's adapters (``parts``) as one PEFT adapter in ``folder``; returns the
    bytes of the weights."""
    tensors = {k: v.to(dtype).contiguous() for p in parts for k, v in p.tensors.items()}
    settings = {pair for p in parts for pair in p.ranks_alphas}
    if len(settings) != 1:
        raise ConfigError(f"LoRA adapters with several (rank, alpha) settings: {sorted(settings)}")
    ((rank, alpha),) = settings
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(t for p in parts for t in p.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return sum(t.numel() * t.element_size() for t in tensors.values())

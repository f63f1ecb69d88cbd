"""LoRA adapters in the PEFT library's format, next to a Hugging Face export: a folder with
``adapter_config.json`` and ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained``
loads onto the base HF model, so the fine-tune ships in a few MB without the frozen weights.

Tensor names are PEFT's: ``base_model.model.<HF module>.lora_A.weight`` (``[r, in]``) and
``lora_B.weight`` (``[out, r]``). Our adapters live in our layout: B's rows take the HF
layout of their layer's weight rows (the query and key projections' rotary permutation), A's
columns need none, since every family's conversion of a linear layer moves rows only (checked
once per kind of layer: an adapter whose layer converts otherwise has no PEFT form). The scale
``alpha / r`` is PEFT's default (no rsLoRA), the targets are the HF modules' full names
(exactly the adapted layers), dropout 0.

Adapters with no PEFT form leave the PEFT folder out (with a warning; the merged export
stands): besides layers whose conversion moves columns, the FFN projections of MoE model types
(DeepSeek-V3, Qwen3-MoE), whose ``gate_proj`` / ``up_proj`` / ``down_proj`` targets ``peft``
moves onto the routed experts when it loads them with ``transformers`` 5.
"""

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

# HF model types whose FFN projection targets peft retargets to the fused routed experts.
_MOE_RETARGETED = {"deepseek_v3", "qwen3_moe"}
_FFN_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class PeftAdapters:
    """The adapters of one rank's model parts, in PEFT names (full tensors, on the host), for
    an HF model of ``model_type``."""

    def __init__(self, model_type: str | None) -> None:
        self.model_type = model_type
        self.tensors: dict[str, torch.Tensor] = {}
        self.targets: list[str] = []
        self.settings: set[tuple[int, float]] = set()
        """(rank, alpha) of the adapters: one pair for a PEFT config."""
        self.problems: list[str] = []
        """Adapters with no PEFT form (recorded, not raised: every rank must hear of them)."""
        self._rows_only: dict[str, bool] = {}

    def add(self, adapter: Any, name: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """The adapter ``a`` ``[r, in]``, ``b`` ``[out, r]`` of our layer weight ``name``
        (full tensors), whose output is scaled by ``scale``."""
        try:
            converted = adapter.to_hf(name, b.detach().cpu())
            ((hf_name, b_hf),) = converted.items()
        except Exception as e:  # a conversion that cannot take B: no PEFT form
            self.problems.append(f"{name}: its HF conversion does not take its adapter ({e})")
            return
        module = hf_name.removesuffix(".weight")
        if self.model_type in _MOE_RETARGETED and module.endswith(_FFN_PROJECTIONS):
            self.problems.append(
                f"{name} ({module}): peft moves {'/'.join(_FFN_PROJECTIONS)} targets of "
                f"{self.model_type} models onto their routed experts"
            )
            return
        if not self._moves_rows_only(adapter, name, b_hf.shape[0]):
            self.problems.append(f"{name}: its conversion to {hf_name} moves columns")
            return
        self.tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().cpu()
        self.tensors[f"base_model.model.{module}.lora_B.weight"] = b_hf
        self.targets.append(module)
        rank = a.shape[0]
        self.settings.add((rank, round(scale * rank, 6)))

    def without_tensors(self) -> "PeftAdapters":
        """A copy of what is known of these adapters, without them (to send to every rank)."""
        copy = PeftAdapters(self.model_type)
        copy.targets, copy.settings, copy.problems = [], set(self.settings), list(self.problems)
        return copy

    def _moves_rows_only(self, adapter: Any, name: str, rows: int) -> bool:
        """Whether converting ``name`` permutes rows only: converting ``X R`` equals
        converting ``X``, then ``R`` (small random ``X``, ``R``, on the host; once per kind of
        layer, the block index left out)."""
        kind = re.sub(r"\.\d+\.", ".N.", name)
        if kind not in self._rows_only:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(rows, 4, generator=g, dtype=torch.float64)
            r = torch.randn(4, 3, generator=g, dtype=torch.float64)
            try:
                (left,) = adapter.to_hf(name, x @ r).values()
                (right,) = adapter.to_hf(name, x).values()
                self._rows_only[kind] = torch.allclose(left, right @ r)
            except Exception:
                self._rows_only[kind] = False
        return self._rows_only[kind]


def peft_problem(parts: list[PeftAdapters]) -> str | None:
    """Why every rank's adapters (``parts``) have no PEFT form together, or ``None``."""
    problems = [problem for part in parts for problem in part.problems]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return problems[0] + more
    settings = {pair for part in parts for pair in part.settings}
    if len(settings) > 1:
        return f"adapters of several (rank, alpha) settings: {sorted(settings)}"
    return None


def write_peft(
    folder: Path, parts: list[PeftAdapters], *, dtype: torch.dtype, base_model: str | None
) -> int:
    """Write every rank's adapters (``parts``, checked by ``peft_problem``) as one PEFT
    adapter in ``folder``; returns the bytes of the weights."""
    tensors = {k: v.to(dtype).contiguous() for p in parts for k, v in p.tensors.items()}
    ((rank, alpha),) = {pair for p in parts for pair in p.settings}
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

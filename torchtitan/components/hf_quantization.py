"""Weights published quantized in Hugging Face folders, read back in float32 (training starts
from them; nothing is trained in these formats). Two layouts, named by ``config.json``'s
``quantization_config``:

- ``fp8`` in blocks (DeepSeek-V3, Qwen3's FP8 models): an fp8 weight ``W`` and, per block of
  ``weight_block_size``, a float32 ``W_scale_inv``; the weight is each block times its scale.
- ``mxfp4`` (gpt-oss's experts): ``W_blocks [..., rows, groups, 16]`` bytes, two 4-bit floats
  (e2m1) each, the low nibble first, and ``W_scales [..., rows, groups]``, one power of two per
  group of 32 values (e8m0: ``2 ** (byte - 127)``); the weight is ``[..., groups x 32, rows]``
  (each row of the blocks is a column of it: the published expert tensors' layout, as
  ``transformers`` dequantizes it).

Any other quantization is refused in one line.
"""

from collections.abc import Callable, Collection
from typing import Any

import torch

from torchtitan.config.errors import ConfigError

_SCALE_INV = "_scale_inv"  # an fp8 weight's per-block scales: ``<name>_scale_inv``
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_BLOCKS, _SCALES = "_blocks", "_scales"  # an mxfp4 tensor's ``<name>_blocks``, ``<name>_scales``
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Quantization:
    """How a folder's tensors are stored: the names it holds as one would read them, and the
    reading of one in float32 (``raw`` reads a stored tensor by its stored name)."""

    description = ""

    def names(self, stored: list[str]) -> list[str]:
        return stored

    def read(self, name: str, raw: Callable[[str], torch.Tensor], stored: Collection[str]):
        return raw(name)


class FP8Blocks(Quantization):
    def __init__(self, block: tuple[int, int], where: str):
        self.block, self.where = block, where
        self.description = f"fp8 weights in {block[0]}x{block[1]} blocks, dequantized"

    def names(self, stored: list[str]) -> list[str]:
        return [n for n in stored if not n.endswith(_SCALE_INV)]

    def read(self, name: str, raw: Callable[[str], torch.Tensor], stored: Collection[str]):
        tensor = raw(name)
        if tensor.dtype not in _FP8:
            return tensor
        if name + _SCALE_INV not in stored:
            raise ConfigError(f"{self.where}: {name} is fp8 without a {name + _SCALE_INV} tensor")
        return dequantize_blocks(tensor, raw(name + _SCALE_INV), self.block)


class MXFP4(Quantization):
    description = "mxfp4 weights (4-bit floats, a power-of-two scale per 32), dequantized"

    def __init__(self, where: str):
        self.where = where
        self._last: tuple[str, torch.Tensor] | None = None
        """The last tensor dequantized: gpt-oss reads ``gate_up_proj`` twice in a row (for
        the gate's columns, then the up projection's)."""

    def names(self, stored: list[str]) -> list[str]:
        names = set(stored)
        out = []
        for name in stored:
            base = name.removesuffix(_BLOCKS).removesuffix(_SCALES)
            if base == name or base + _BLOCKS not in names or base + _SCALES not in names:
                out.append(name)
            elif name.endswith(_BLOCKS):
                out.append(base)
        return out

    def read(self, name: str, raw: Callable[[str], torch.Tensor], stored: Collection[str]):
        if name in stored:
            return raw(name)
        if self._last is None or self._last[0] != name:
            self._last = None  # (freed before the next one is made)
            self._last = (name, dequantize_mxfp4(raw(name + _BLOCKS), raw(name + _SCALES)))
        return self._last[1]


def quantization(config: dict[str, Any], where: str) -> Quantization:
    """The layout ``config`` (a ``config.json``) names; a plain one for no quantization."""
    quantized = config.get("quantization_config")
    if not quantized:
        return Quantization()
    method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
    block = quantized.get("weight_block_size") if isinstance(quantized, dict) else None
    if method == "fp8" and isinstance(block, list) and len(block) == 2:
        return FP8Blocks((int(block[0]), int(block[1])), where)
    if method == "mxfp4":
        return MXFP4(where)
    raise ConfigError(
        f"{where}: the weights are quantized ({method}, quantization_config in config.json) "
        "in a way this loader does not read (it reads fp8 in blocks, weight_block_size, and "
        "mxfp4); dequantize them to bf16 or fp32 first (e.g. with transformers), then load that"
    )


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``weight`` (fp8, ``[rows, columns]``) in float32: each ``block`` of it times its entry of
    ``scale_inv`` (``[ceil(rows / block[0]), ceil(columns / block[1])]``)."""
    rows, columns = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    scales = scales.repeat_interleave(block[1], 1)[:, :columns]
    return weight.float() * scales


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., rows, groups, 16]`` (uint8: two e2m1 values each, low nibble first) and
    ``scales [..., rows, groups]`` (uint8 exponents, bias 127) as ``[..., groups x 32, rows]``
    in bfloat16, which holds every such value exactly (half float32's memory: gpt-oss-120b's
    ``gate_up_proj`` is 2.1 G values a block). Decoded a slice of the leading dim at a time,
    so the temporaries stay small."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}")
    table = torch.tensor(_E2M1, dtype=torch.float32)
    *lead, rows, groups, _ = blocks.shape
    blocks, scales = blocks.reshape(-1, rows, groups, 16), scales.reshape(-1, rows, groups)
    out = torch.empty(blocks.shape[0], groups * 32, rows, dtype=torch.bfloat16)
    for i, (block, scale) in enumerate(zip(blocks, scales, strict=True)):
        block = block.to(torch.uint8)
        values = torch.stack([table[(block & 0x0F).long()], table[(block >> 4).long()]], -1)
        values = torch.ldexp(values.flatten(-2), scale.to(torch.int32).unsqueeze(-1) - 127)
        out[i] = values.flatten(-2).T
    return out.view(*lead, groups * 32, rows)

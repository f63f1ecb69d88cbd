"""gpt-oss weights to and from Hugging Face ``transformers`` (``GptOssForCausalLM``, a test-only
dependency): logits of the same tokens agree both ways (sinks, sliding windows, YaRN, biased
projections and experts, the clamped SwiGLU), HF -> ours -> HF is bit-identical, a folder with
the experts in mxfp4 (as published) loads as ``transformers`` dequantizes it, and the published
sizes have transformers' parameter counts."""

import dataclasses
import json

import pytest
import torch
from hf_models import build_ours, logits
from safetensors.torch import load_file, save_file

from torchtitan.components import checkpoint_hf, hf_quantization
from torchtitan.config.errors import ConfigError
from torchtitan.models.gpt_oss.args import flavors
from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from torchtitan.models.llama3.model import Transformer

transformers = pytest.importorskip("transformers")

# Two blocks (a windowed one, then a full one), a window shorter than the tokens.
ARGS = dataclasses.replace(flavors["debugmodel"], n_layers=2, max_seq_len=64, sliding_window=8)
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


def _hf_config(args=ARGS, **changes):
    m = args.moe
    fields = dict(
        hidden_size=args.dim, intermediate_size=args.moe_hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab_size,
        num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
        sliding_window=args.sliding_window, max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": args.rope_theta, "factor": 32.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )  # fmt: skip
    return transformers.GptOssConfig(**(fields | changes))


def _hf_model():
    torch.manual_seed(1)
    model = transformers.GptOssForCausalLM(_hf_config()).eval()
    with torch.no_grad():  # every tensor random and visible: norms, biases, sinks
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name or "sinks" in name:
                p.normal_(0, 0.5)
            elif "experts" in name:
                p.normal_(0, 0.05)
    return model


def _ours(args=ARGS) -> Transformer:
    return build_ours(args)


def _logits(model, hf: bool = False) -> torch.Tensor:
    return logits(model, TOKENS, hf)


def test_import_export_and_round_trip(tmp_path):
    hf = _hf_model()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = _ours()
    adapter = GptOssStateDictAdapter(ARGS)
    checkpoint_hf.load_hf_([ours], adapter, tmp_path / "hf")
    torch.testing.assert_close(_logits(ours), _logits(hf, hf=True), atol=1e-5, rtol=1e-5)

    checkpoint_hf.save_hf(
        [ours], adapter, tmp_path / "back", dtype=torch.float32, writer=True, pipelined=False
    )
    before, after = (checkpoint_hf.read_tensors(tmp_path / d) for d in ("hf", "back"))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert again.config.layer_types == hf.config.layer_types
    torch.testing.assert_close(_logits(again, hf=True), _logits(ours), atol=1e-5, rtol=1e-5)


def test_our_trained_model_exports_to_transformers(tmp_path):
    """From our side: a model initialised (and stepped) here computes in transformers what it
    computes here."""
    ours = _ours()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    checkpoint_hf.save_hf(
        [ours], GptOssStateDictAdapter(ARGS), tmp_path / "hf", dtype=torch.float32,
        writer=True, pipelined=False,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    torch.testing.assert_close(_logits(hf, hf=True), _logits(ours), atol=1e-5, rtol=1e-5)


def _quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The published layout of an expert tensor ``[E, in, out]``: per output row, groups of 32
    inputs, each a power-of-two scale (e8m0) and 4-bit e2m1 values, two to a byte (low first)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    rows = weight.transpose(1, 2)  # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.to(torch.uint8).view(*codes.shape[:-1], 16, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_an_mxfp4_folder_loads_as_transformers_dequantizes_it(tmp_path):
    """The experts' weights stored as published (``_blocks`` + ``_scales``, mxfp4 in
    ``quantization_config``): read as ``transformers``' own dequantization gives them, and the
    model computes the dequantized HF model's logits."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tensors = load_file(tmp_path / "hf/model.safetensors")
    dequantized = {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = _quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(hf_quantization.dequantize_mxfp4(blocks, scales).float(), want)
        assert (want - hf.state_dict()[name]).abs().max() > 0  # 4 bits round
        dequantized[name] = want
    save_file(tensors, tmp_path / "hf/model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf/config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (tmp_path / "hf/config.json").write_text(json.dumps(config))

    read = checkpoint_hf.read_tensors(tmp_path / "hf")
    assert not any(n.endswith(("_blocks", "_scales")) for n in read)
    for name, want in dequantized.items():
        assert torch.equal(read[name].float(), want), name
    ours = _ours()
    checkpoint_hf.load_hf_([ours], GptOssStateDictAdapter(ARGS), tmp_path / "hf")
    hf.load_state_dict(hf.state_dict() | dequantized)
    torch.testing.assert_close(_logits(ours), _logits(hf, hf=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"sliding_window": 16}, r"sliding_window=16 \(flavor: 8\)"),
        ({"num_experts_per_tok": 4}, r"num_experts_per_tok=4 \(flavor: 2\)"),
        ({"swiglu_limit": 10.0}, r"swiglu_limit=10.0 \(ours: 7.0\)"),
        ({"layer_types": ["full_attention", "full_attention"]}, "layer_types="),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 8.0,
                    "original_max_position_embeddings": 4096,
                }
            },
            r"rope scaling factor=8.0 \(flavor: 32.0\), truncate=True",
        ),  # fmt: skip
        ({"model_type": "qwen3"}, "model_type 'qwen3' is not 'gpt_oss'"),
        ({"quantization_config": {"quant_method": "awq"}}, r"quantized \(awq"),
    ],
)
def test_folders_that_would_compute_otherwise_are_refused(tmp_path, change, expected):
    _hf_model().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    (tmp_path / "hf/config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=expected):
        checkpoint_hf.load_hf_([_ours()], GptOssStateDictAdapter(ARGS), tmp_path / "hf")


@pytest.mark.parametrize("flavor", ["20b", "120b"])
def test_published_sizes_have_transformers_parameter_counts(flavor):
    args = flavors[flavor]
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(
            _hf_config(args, max_position_embeddings=131072, sliding_window=128)
        )
        ours = Transformer(args)
    want = sum(p.numel() for p in hf.parameters())
    assert args.num_params() == want == sum(p.numel() for p in ours.parameters())
    # The model card's figures: 20.9 B and 116.8 B in all, 3.61 B and 5.13 B active per token
    # (the output projection counted, the embedding lookup not).
    total, active = {"20b": (20.9e9, 3.61e9), "120b": (116.8e9, 5.13e9)}[flavor]
    assert args.num_params() == pytest.approx(total, rel=0.005)
    assert args.num_params(activated=True, exclude_embedding=True) == pytest.approx(
        active, rel=0.005
    )

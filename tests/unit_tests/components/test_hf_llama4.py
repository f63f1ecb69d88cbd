"""Llama 4 text weights to and from Hugging Face ``transformers`` (``Llama4ForCausalLM``, a
test-only dependency): logits of the same tokens agree both ways (chunked attention, blocks
without RoPE and their query temperature, weightless query/key norms, top-1 experts scaled on
the way in, a shared expert, dense blocks between), HF -> ours -> HF is bit-identical, the
published multimodal layout (``language_model.``, ``text_config``) loads, and the published
sizes have transformers' parameter counts."""

import dataclasses
import json

import pytest
import torch
from hf_models import build_ours, logits
from safetensors.torch import load_file, save_file

from torchtitan.components import checkpoint_hf
from torchtitan.config.errors import ConfigError
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama4.args import flavors
from torchtitan.models.llama4.state_dict_adapter import Llama4StateDictAdapter

transformers = pytest.importorskip("transformers")

ARGS = dataclasses.replace(flavors["debugmodel"], max_seq_len=64)
# Longer than a chunk (32) and past the temperature's first step (position 15).
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def _hf_config(args=ARGS, **changes):
    m = args.moe
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope = {
            "rope_type": "llama3", "rope_theta": args.rope_theta, "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }  # fmt: skip
    floor_scale, attn_scale = args.nope_temperature
    fields = dict(
        hidden_size=args.dim, intermediate_size=args.moe_hidden_dim,
        intermediate_size_mlp=args.ffn_hidden_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, vocab_size=args.vocab_size, num_local_experts=m.num_experts,
        num_experts_per_tok=m.top_k, interleave_moe_layer_step=args.moe_every,
        no_rope_layer_interval=args.nope_every, attention_chunk_size=args.attention_chunk,
        use_qk_norm=args.qk_l2_norm, floor_scale=int(floor_scale), attn_scale=attn_scale,
        max_position_embeddings=64, rope_parameters=rope,
    )  # fmt: skip
    return transformers.Llama4TextConfig(**(fields | changes))


def _hf_model():
    torch.manual_seed(1)
    model = transformers.Llama4ForCausalLM(_hf_config()).eval()
    with torch.no_grad():  # norms random too; experts and router large enough to matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "experts" in name or "router" in name:
                p.normal_(0, 0.1)
    return model


def _ours(args=ARGS) -> Transformer:
    return build_ours(args)


def _logits(model, hf: bool = False) -> torch.Tensor:
    return logits(model, TOKENS, hf)


def test_import_export_and_round_trip(tmp_path):
    hf = _hf_model()
    assert hf.config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert hf.config.moe_layers == [1, 3]
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = _ours()
    adapter = Llama4StateDictAdapter(ARGS)
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
    assert type(again).__name__ == "Llama4ForCausalLM"
    torch.testing.assert_close(_logits(again, hf=True), _logits(ours), atol=1e-5, rtol=1e-5)


def test_the_published_multimodal_layout_loads_its_text_model(tmp_path):
    """The published folders are ``Llama4ForConditionalGeneration``: the text model's tensors
    under ``language_model.``, its shapes in ``text_config``, a vision encoder beside (not
    read)."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tensors = load_file(tmp_path / "hf/model.safetensors")
    tensors = {f"language_model.{name}": t for name, t in tensors.items()}
    tensors["vision_model.patch_embedding.linear.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "hf/model.safetensors", metadata={"format": "pt"})
    text = json.loads((tmp_path / "hf/config.json").read_text())
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
              "text_config": text, "vision_config": {"hidden_size": 4}}  # fmt: skip
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    ours = _ours()
    checkpoint_hf.load_hf_([ours], Llama4StateDictAdapter(ARGS), tmp_path / "hf")
    torch.testing.assert_close(_logits(ours), _logits(hf, hf=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"attention_chunk_size": 16}, r"attention_chunk_size=16 \(flavor: 32\)"),
        ({"interleave_moe_layer_step": 1, "moe_layers": None}, r"moe_layers=\[0, 1, 2, 3\]"),
        ({"use_qk_norm": False}, r"use_qk_norm=False \(flavor: True\)"),
        ({"floor_scale": 8192}, "floor_scale, attn_scale"),
        ({"model_type": "llama"}, "model_type 'llama' is not 'llama4_text'"),
    ],
)
def test_folders_that_would_compute_otherwise_are_refused(tmp_path, change, expected):
    _hf_model().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    (tmp_path / "hf/config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=expected):
        checkpoint_hf.load_hf_([_ours()], Llama4StateDictAdapter(ARGS), tmp_path / "hf")


@pytest.mark.parametrize(
    "flavor, total, active",
    # The model cards' 109B and 400B count the vision encoder too (about 1B): the text
    # models are 107.8B and 400.7B; both activate about 17B per token.
    [("17bx16e", 107.8e9, 17.2e9), ("17bx128e", 400.7e9, 17.2e9)],
)
def test_published_sizes_have_transformers_parameter_counts(flavor, total, active):
    args = flavors[flavor]
    with torch.device("meta"):
        hf = transformers.Llama4ForCausalLM(_hf_config(args, max_position_embeddings=8192))
        ours = Transformer(dataclasses.replace(args, max_seq_len=8))
    want = sum(p.numel() for p in hf.parameters())
    assert args.num_params() == want == sum(p.numel() for p in ours.parameters())
    assert args.num_params() == pytest.approx(total, rel=0.002)
    assert args.num_params(activated=True) == pytest.approx(active, rel=0.01)

"""Llama 3 weights to and from Hugging Face ``transformers`` (a test-only dependency): logits
of the same tokens agree both ways, and HF -> ours -> HF is bit-identical."""

import dataclasses
import json

import pytest
import torch

from torchtitan.components import checkpoint_hf, hf_quantization
from torchtitan.config.errors import ConfigError
from torchtitan.models.llama3.args import flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

transformers = pytest.importorskip("transformers")

ARGS = dataclasses.replace(flavors["debugmodel"], n_layers=2, max_seq_len=64)
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


def _hf_model(tied: bool):
    config = transformers.LlamaConfig(
        hidden_size=ARGS.dim, intermediate_size=ARGS.ffn_hidden_dim,
        num_hidden_layers=ARGS.n_layers, num_attention_heads=ARGS.n_heads,
        num_key_value_heads=ARGS.kv_heads, vocab_size=ARGS.vocab_size,
        rms_norm_eps=ARGS.norm_eps, rope_theta=ARGS.rope_theta, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _ours(args=ARGS) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_export_and_round_trip(tmp_path, tied):
    hf = _hf_model(tied)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert checkpoint_hf.is_hf_folder(tmp_path / "hf")

    ours = _ours()  # untied: a tied HF model's output gets a copy of the embedding
    adapter = Llama3StateDictAdapter(ARGS)
    checkpoint_hf.load_hf_([ours], adapter, tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), _hf_logits(hf), rtol=1e-5, atol=1e-5)

    # Round trip: written back, every tensor and the tying are the same bits.
    checkpoint_hf.save_hf(
        [ours], adapter, tmp_path / "back", dtype=torch.float32, writer=True, pipelined=False
    )
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    original = checkpoint_hf.read_tensors(tmp_path / "hf")
    back = checkpoint_hf.read_tensors(tmp_path / "back")
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name

    # Ours after training steps, loaded by transformers: the same logits.
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ours.train()
    for _ in range(3):
        logits = ours(TOKENS)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    ours.eval()
    checkpoint_hf.save_hf(
        [ours], adapter, tmp_path / "trained", dtype=torch.float32, writer=True,
        pipelined=False, max_shard_bytes=2**20,  # several shards and an index
    )  # fmt: skip
    assert len(set(json.loads((tmp_path / "trained" / checkpoint_hf.INDEX).read_text())
                   ["weight_map"].values())) > 1  # fmt: skip
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "trained").eval()
    assert not loaded.config.tie_word_embeddings  # trained apart
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(loaded), ours(TOKENS), rtol=1e-5, atol=1e-5)


def test_tied_flavor_imports_a_tied_model(tmp_path):
    hf = _hf_model(tied=True)
    hf.save_pretrained(tmp_path / "hf")
    args = dataclasses.replace(ARGS, tie_word_embeddings=True)
    ours = _ours(args)
    checkpoint_hf.load_hf_([ours], Llama3StateDictAdapter(args), tmp_path / "hf")
    assert ours.output.weight is ours.tok_embeddings.weight
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), _hf_logits(hf), rtol=1e-5, atol=1e-5)


def test_a_model_of_other_shapes_is_refused_in_one_line(tmp_path):
    _hf_model(tied=False).save_pretrained(tmp_path / "hf")
    other = dataclasses.replace(ARGS, n_layers=3)
    with pytest.raises(ConfigError, match="num_hidden_layers=2 \\(flavor: 3\\)") as error:
        checkpoint_hf.load_hf_([_ours(other)], Llama3StateDictAdapter(other), tmp_path / "hf")
    assert "\n" not in str(error.value)


def test_convert_script_round_trips_through_a_dcp_checkpoint(tmp_path, capsys):
    """HF folder -> DCP step-0 (flavor found by shapes) -> HF folder (flavor from the saved
    config): the same bits."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "scripts/convert_hf.py"
    spec = importlib.util.spec_from_file_location("convert_hf", script)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)

    a = flavors["debugmodel"]
    config = transformers.LlamaConfig(
        hidden_size=a.dim, intermediate_size=a.ffn_hidden_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab_size,
        rope_theta=a.rope_theta, rms_norm_eps=a.norm_eps,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    # The folder's tokenizer goes into the checkpoint's config, and from there back out.
    tokenizer = Path(__file__).resolve().parents[3] / "tests/assets/tokenizer_hf/tokenizer.json"
    (tmp_path / "hf/tokenizer.json").write_bytes(tokenizer.read_bytes())
    assert convert.main(["from_hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert convert.main(["to_hf", str(tmp_path / "ckpt/step-0"), str(tmp_path / "back")]) == 0
    original = checkpoint_hf.read_tensors(tmp_path / "hf")
    back = checkpoint_hf.read_tensors(tmp_path / "back")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    assert (tmp_path / "back/tokenizer.json").read_bytes() == tokenizer.read_bytes()
    # The source had no tokenizer_config.json: the export names bos and eos for transformers.
    config = json.loads((tmp_path / "back/tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")

    # An export never writes into a folder that holds files (old shards would mix with new).
    before = sorted(p.name for p in (tmp_path / "back").iterdir())
    assert convert.main(["to_hf", str(tmp_path / "ckpt/step-0"), str(tmp_path / "back")]) == 2
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == before
    # A checkpoint converted as another flavor or family: one line, nothing written.
    for flags in (["--flavor", "debug_100m"], ["--module", "qwen3", "--flavor", "debugmodel"]):
        out = tmp_path / f"wrong_{flags[-1]}"
        assert convert.main(["to_hf", str(tmp_path / "ckpt/step-0"), str(out), *flags]) == 2
        assert not out.exists()
    # A source that is not there is named as such, whatever else is passed.
    for direction in ("to_hf", "from_hf"):
        argv = [direction, str(tmp_path / "missing"), str(tmp_path / "x"), "--module", "llama3"]
        assert convert.main(argv) == 2
        assert f"{tmp_path / 'missing'} does not exist" in capsys.readouterr().err
        assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"rms_norm_eps": 1e-2}, r"rms_norm_eps=0\.01 \(ours: 1e-05\)"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantized \(fp8.*in blocks"),
        ({"quantization_config": {"quant_method": "gptq"}}, r"quantized \(gptq"),
        ({"rope_theta": None, "rope_parameters": None}, "rope_theta 10000.0 differs"),  # HF's
    ],
)
def test_folders_that_would_compute_otherwise_are_refused(tmp_path, change, expected):
    _hf_model(tied=False).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    (tmp_path / "hf/config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=expected):
        checkpoint_hf.load_hf_([_ours(ARGS)], Llama3StateDictAdapter(ARGS), tmp_path / "hf")


def _quantize_blocks(weight: torch.Tensor, block: tuple[int, int]):
    """DeepSeek's published layout: fp8 e4m3 weights, one float32 ``scale_inv`` per block
    (the block's max magnitude over fp8's largest value)."""
    rows, columns = weight.shape
    grid = (-(-rows // block[0]), -(-columns // block[1]))
    scale_inv = torch.empty(grid)
    quantized = torch.empty_like(weight, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            cut = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale_inv[i, j] = weight[cut].abs().max().clamp(min=1e-12) / 448.0
            quantized[cut] = (weight[cut] / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale_inv


def test_an_fp8_block_quantized_folder_loads_dequantized(tmp_path):
    """The layers' linear weights in fp8 with 32x16 blocks (rows and columns not multiples of
    the block): each loads as its blocks times their scales; the rest loads as saved."""
    from safetensors.torch import load_file, save_file

    hf = _hf_model(tied=False)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tensors = load_file(tmp_path / "hf/model.safetensors")
    block, expected = (32, 16), {}
    for name in [n for n in tensors if ".layers." in n and "proj" in n]:
        quantized, scale_inv = _quantize_blocks(tensors[name], block)
        tensors[name], tensors[name + "_scale_inv"] = quantized, scale_inv
        expected[name] = hf_quantization.dequantize_blocks(quantized, scale_inv, block)
        assert (expected[name] - hf.state_dict()[name]).abs().max() > 0  # fp8 rounds
    save_file(tensors, tmp_path / "hf/model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf/config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
        "activation_scheme": "dynamic",
    }  # fmt: skip
    (tmp_path / "hf/config.json").write_text(json.dumps(config))

    read = checkpoint_hf.read_tensors(tmp_path / "hf")
    assert not any(n.endswith("_scale_inv") for n in read)
    for name, want in expected.items():
        assert torch.equal(read[name], want), name
    assert torch.equal(read["model.norm.weight"], hf.state_dict()["model.norm.weight"])
    ours = _ours()
    checkpoint_hf.load_hf_([ours], Llama3StateDictAdapter(ARGS), tmp_path / "hf")
    hf.load_state_dict({n: expected.get(n, t) for n, t in hf.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), _hf_logits(hf), atol=1e-5, rtol=1e-5)
    del tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "hf/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="q_proj.weight is fp8 without a .*_scale_inv"):
        checkpoint_hf.load_hf_([_ours()], Llama3StateDictAdapter(ARGS), tmp_path / "hf")


def test_a_tied_flavor_refuses_an_untied_model(tmp_path):
    _hf_model(tied=False).save_pretrained(tmp_path / "hf")
    args = dataclasses.replace(ARGS, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="lm_head.* differs from its embedding"):
        checkpoint_hf.load_hf_([_ours(args)], Llama3StateDictAdapter(args), tmp_path / "hf")


def test_greedy_generation_equals_transformers_generate(tmp_path):
    from torchtitan.generate import generate

    hf = _hf_model(tied=False)
    hf.save_pretrained(tmp_path / "hf")
    ours = _ours()
    checkpoint_hf.load_hf_([ours], Llama3StateDictAdapter(ARGS), tmp_path / "hf")
    prompt = TOKENS[0, :7]
    with torch.no_grad():
        theirs = hf.generate(
            prompt.unsqueeze(0), attention_mask=torch.ones(1, 7, dtype=torch.long),
            do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0,
        )[0, 7:].tolist()  # fmt: skip
    assert generate(ours, prompt.tolist(), max_new_tokens=16) == theirs
    # Sampling: the same seed gives the same tokens; top-k 1 is greedy.
    sampled = generate(ours, prompt.tolist(), max_new_tokens=16, temperature=1.0, seed=3)
    assert sampled == generate(ours, prompt.tolist(), max_new_tokens=16, temperature=1.0, seed=3)
    assert sampled != theirs
    assert generate(ours, prompt.tolist(), max_new_tokens=16, temperature=1.0, top_k=1) == theirs

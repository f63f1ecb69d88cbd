"""DeepSeek-V3 weights to and from ``transformers``' ``DeepseekV3ForCausalLM``: per-expert
tensors, the routing bias, MLA's projections; logits agree both ways, round trip bit-identical."""

import dataclasses
import json

import pytest
import torch

from torchtitan.components import checkpoint_hf
from torchtitan.config.errors import ConfigError
from torchtitan.models.deepseek_v3.args import flavors
from torchtitan.models.deepseek_v3.model import Transformer
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

transformers = pytest.importorskip("transformers")

ARGS = dataclasses.replace(flavors["debugmodel"], n_layers=3, max_seq_len=64)
# YaRN on: a table longer than the pretraining length, with the 671B flavor's temperature.
YARN = dataclasses.replace(ARGS, original_seq_len=16, rope_factor=4.0, mscale=0.707)
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def _hf_model(args=ARGS):
    """A random HF model of ``args``' shapes (its config as our export writes it)."""
    fields = DeepSeekV3StateDictAdapter(args).hf_config(
        tied=False, dtype=torch.float32, bos_id=None, eos_id=None
    )
    config = transformers.DeepseekV3Config(**fields)
    torch.manual_seed(1)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # norms and routing bias random too, so a swap would show
        for name, t in model.state_dict().items():
            if "norm" in name:
                t.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in name:
                t.uniform_(-0.05, 0.05)
    return model


def _ours(args=ARGS) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("args", [ARGS, YARN], ids=["rope", "yarn"])
def test_import_export_and_round_trip(tmp_path, args):
    hf = _hf_model(args)
    if args is YARN:  # the export says so, and transformers reads it
        assert hf.config.rope_scaling["rope_type"] == "yarn"
    hf.save_pretrained(tmp_path / "hf")
    ours = _ours(args)
    adapter = DeepSeekV3StateDictAdapter(args)
    checkpoint_hf.load_hf_([ours], adapter, tmp_path / "hf")
    assert ours.layers["2"].moe.expert_bias.abs().sum() > 0  # the routing bias came along
    with torch.no_grad():
        want = hf(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), want, rtol=1e-5, atol=1e-5)

    checkpoint_hf.save_hf(
        [ours], adapter, tmp_path / "back", dtype=torch.float32, writer=True, pipelined=False
    )
    original = checkpoint_hf.read_tensors(tmp_path / "hf")
    back = checkpoint_hf.read_tensors(tmp_path / "back")
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name

    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS).logits, want, rtol=1e-5, atol=1e-5)


def test_other_routing_is_refused_in_one_line(tmp_path):
    hf = _hf_model()
    hf.config.routed_scaling_factor = 2.5
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="routed_scaling_factor=2.5 \\(flavor: 1.0\\)") as e:
        checkpoint_hf.load_hf_([_ours()], DeepSeekV3StateDictAdapter(ARGS), tmp_path / "hf")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("args", "change", "expected"),
    [
        (
            ARGS,
            {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
            "rope_theta 50000.0 differs",
        ),  # fmt: skip
        (ARGS, {"rms_norm_eps": 1e-2}, r"rms_norm_eps=0\.01 \(ours: 1e-06\)"),
        (ARGS, {"hidden_act": "gelu"}, "hidden_act=gelu"),
        # The published V3 config scales (YaRN) at every length; ours beyond original_seq_len.
        (
            ARGS,
            {
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 40.0,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096,
                }
            },
            "train longer sequences",
        ),  # fmt: skip
        (YARN, {"rope_scaling": None, "rope_parameters": None}, "does not scale"),
        (
            dataclasses.replace(ARGS, moe=dataclasses.replace(ARGS.moe, score_func="softmax")),
            {},
            "routes with softmax scores",
        ),  # fmt: skip
    ],
)
def test_folders_that_would_compute_otherwise_are_refused(tmp_path, args, change, expected):
    hf = _hf_model(YARN if args is YARN else ARGS)
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    (tmp_path / "hf/config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=expected) as e:
        checkpoint_hf.load_hf_([_ours(args)], DeepSeekV3StateDictAdapter(args), tmp_path / "hf")
    assert "\n" not in str(e.value)


def test_a_bf16_export_keeps_the_routing_in_float32(tmp_path):
    """transformers keeps the router and its bias in float32: a bias step of 1e-3 is under
    bf16's spacing near 0.5."""
    ours = _ours()
    with torch.no_grad():
        ours.layers["2"].moe.expert_bias.fill_(0.5 + 1e-3)
    checkpoint_hf.save_hf(
        [ours], DeepSeekV3StateDictAdapter(ARGS), tmp_path / "bf16", dtype=torch.bfloat16,
        writer=True, pipelined=False,
    )  # fmt: skip
    tensors = checkpoint_hf.read_tensors(tmp_path / "bf16")
    bias = tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias[0].item() == pytest.approx(0.501)
    assert tensors["model.layers.2.mlp.gate.weight"].dtype == torch.float32
    assert tensors["model.layers.2.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16


def test_token_ids_zero_are_written():
    """DeepSeek's bos is token 0: ``config.json`` keeps it (a falsy id was once dropped)."""
    fields = DeepSeekV3StateDictAdapter(ARGS).hf_config(
        tied=False, dtype=torch.float32, bos_id=0, eos_id=1
    )
    assert (fields["bos_token_id"], fields["eos_token_id"]) == (0, 1)


def test_sampling_builds_the_model_the_run_trained(tmp_path, monkeypatch):
    """A checkpoint of a run at --training.seq_len 8192 (past DeepSeek-V3's original 4096:
    YaRN on) samples with YaRN; its relative tokenizer path resolves from any directory."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.checkpoint_states import ModelState
    from torchtitan.config.job_config import Checkpoint
    from torchtitan.generate import load_model
    from torchtitan.models.deepseek_v3.model import precompute_yarn_cis

    trained = dataclasses.replace(flavors["debugmodel"], max_seq_len=8192)
    model = _ours(trained)
    run_config = (
        '[model]\nname = "deepseek_v3"\nflavor = "debugmodel"\n'
        'tokenizer_path = "tests/assets/tokenizer"\n[training]\nseq_len = 8192\n'
    )
    CheckpointManager(
        Checkpoint(enable=True, folder="checkpoint"), dump_folder=str(tmp_path),
        states={"model": ModelState([model])}, device_type="cpu", run_config=run_config,
    ).save(1, model_only=True)  # fmt: skip
    monkeypatch.chdir(tmp_path)  # not the repository
    loaded, args, tokenizer = load_model(tmp_path, None, None, torch.device("cpu"))
    assert args.max_seq_len == 8192 and tokenizer.is_dir()
    assert torch.equal(loaded.rope_cis, precompute_yarn_cis(trained))
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS), model(TOKENS), rtol=0, atol=0)

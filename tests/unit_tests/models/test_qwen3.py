"""Qwen3 (dense): the published shapes, and weights to and from ``transformers``'
``Qwen3ForCausalLM`` (a test-only dependency) with the same logits both ways."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from torchtitan.components import checkpoint_hf, hf_config
from torchtitan.config.errors import ConfigError
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.qwen3.args import flavors
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

transformers = pytest.importorskip("transformers")

# The published non-embedding counts (embedding and output projection excluded), in billions.
PUBLISHED_NON_EMBEDDING = {
    "0.6B": 0.44,
    "1.7B": 1.4,
    "4B": 3.6,
    "8B": 6.95,
    "14B": 13.2,
    "32B": 31.2,
}
# The published config.json of Qwen/Qwen3-<size>: hidden_size, intermediate_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, tie_word_embeddings (head_dim
# 128, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6 in all).
PUBLISHED_CONFIGS = {
    "0.6B": (1024, 3072, 28, 16, 8, True),
    "1.7B": (2048, 6144, 28, 16, 8, True),
    "4B": (2560, 9728, 36, 32, 8, True),
    "8B": (4096, 12288, 36, 32, 8, False),
    "14B": (5120, 17408, 40, 40, 8, False),
    "32B": (5120, 25600, 64, 64, 8, False),
}  # fmt: skip
ARGS = dataclasses.replace(flavors["debugmodel"], n_layers=2, max_seq_len=64)
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


def _hf_config(args, tied: bool):
    return transformers.Qwen3Config(
        hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab_size,
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )  # fmt: skip


def _ours(args=ARGS) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("flavor", sorted(PUBLISHED_NON_EMBEDDING))
def test_flavor_param_counts_match_transformers_and_published(flavor):
    args = flavors[flavor]
    shape = (args.dim, args.ffn_hidden_dim, args.n_layers, args.n_heads, args.kv_heads)
    assert (*shape, args.tie_word_embeddings) == PUBLISHED_CONFIGS[flavor]
    assert (args.head_dim, args.vocab_size, args.rope_theta, args.norm_eps) == (
        128, 151936, 1e6, 1e-6,
    )  # fmt: skip
    with torch.device("meta"):
        ours = sum(p.numel() for p in Transformer(args).parameters())
        theirs = transformers.Qwen3ForCausalLM(_hf_config(args, args.tie_word_embeddings))
    assert ours == args.num_params() == sum(p.numel() for p in theirs.parameters())
    embedding = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
    non_embedding = (args.num_params() - embedding) / 1e9
    assert non_embedding == pytest.approx(PUBLISHED_NON_EMBEDDING[flavor], abs=0.05)  # rounded


def test_the_query_norm_weighs_in():
    """(Its place, per head and before the rotary embedding, is checked against transformers'
    logits below.)"""
    attention = _ours().layers["0"].attention
    assert attention.q_norm.weight.shape == (ARGS.head_dim,) != (ARGS.dim,)
    x = torch.randn(1, 5, ARGS.dim)
    with torch.no_grad():
        attention.q_norm.weight.mul_(3.0)  # a changed query norm changes the output
        before = attention(x, _ours().rope_cis[:5])
        attention.q_norm.weight.div_(3.0)
        assert not torch.allclose(before, attention(x, _ours().rope_cis[:5]))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_export_and_round_trip(tmp_path, tied):
    torch.manual_seed(1)
    hf = transformers.Qwen3ForCausalLM(_hf_config(ARGS, tied)).eval()
    with torch.no_grad():  # random norms too (the per-head ones included): a swap would show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits

    ours = _ours()
    adapter = Qwen3StateDictAdapter(ARGS)
    checkpoint_hf.load_hf_([ours], adapter, tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), want, rtol=1e-5, atol=1e-5)

    checkpoint_hf.save_hf(
        [ours], adapter, tmp_path / "out", dtype=torch.float32, writer=True, pipelined=False
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "Qwen3ForCausalLM" and back.config.tie_word_embeddings == tied
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, want, rtol=1e-5, atol=1e-5)
    original, exported = (checkpoint_hf.read_tensors(tmp_path / d) for d in ("hf", "out"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_a_llama_folder_is_refused_in_one_line(tmp_path):
    config = transformers.LlamaConfig(
        hidden_size=ARGS.dim, intermediate_size=ARGS.ffn_hidden_dim, num_hidden_layers=2,
        num_attention_heads=ARGS.n_heads, num_key_value_heads=ARGS.kv_heads,
        vocab_size=ARGS.vocab_size, head_dim=ARGS.head_dim,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="model_type 'llama' is not 'qwen3'"):
        checkpoint_hf.load_hf_([_ours()], Qwen3StateDictAdapter(ARGS), tmp_path / "hf")


def test_a_qwen3_folder_is_found_to_be_qwen3_without_module(tmp_path):
    """Sampling and ``convert_hf.py from_hf`` take an HF folder without ``--module``: its
    ``config.json``'s ``model_type`` picks the family, the shapes the flavor."""
    from torchtitan.generate import load_model

    args = dataclasses.replace(flavors["debugmodel"], max_seq_len=64)
    torch.manual_seed(2)
    hf = transformers.Qwen3ForCausalLM(_hf_config(args, tied=False)).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert hf_config.hf_family(tmp_path / "hf") == "qwen3"
    model, found, _ = load_model(tmp_path / "hf", None, None, torch.device("cpu"))
    assert found == args  # the folder's max_position_embeddings sizes the RoPE table
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, rtol=1e-5, atol=1e-5)


def _save(tmp_path: Path, name: str, args=ARGS, **overrides) -> Path:
    config = _hf_config(args, tied=False)
    for key, value in overrides.items():
        setattr(config, key, value)
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path / name)
    return tmp_path / name


def test_family_and_flavor_come_from_the_folder(tmp_path):
    from torchtitan.models.llama3.args import flavors as llama_flavors
    from torchtitan.models.spec import get_model_spec

    folder = _save(tmp_path, "qwen3")
    a = llama_flavors["debugmodel"]
    llama = transformers.LlamaConfig(
        hidden_size=a.dim, intermediate_size=a.ffn_hidden_dim, num_hidden_layers=1,
        num_attention_heads=a.n_heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab_size,
    )  # fmt: skip
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    assert hf_config.hf_family(tmp_path / "llama") == "llama3"
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": None}))
    assert hf_config.hf_family(folder) is None
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match="model_type 'qwen3' is not llama3's .* pass the --module"
    ):
        hf_config.matching_flavor(get_model_spec("llama3"), folder)
    full = _save(tmp_path, "full", dataclasses.replace(flavors["debugmodel"], max_seq_len=64))
    assert hf_config.matching_flavor(get_model_spec("qwen3"), full) == "debugmodel"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                              "original_max_position_embeddings": 32}},
         r"scales its rotary embedding \(yarn\), this flavor does not"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
         "rope_theta 10000.0 differs from the flavor's 1000000.0"),
    ],
)  # fmt: skip
def test_other_rotary_settings_are_refused(tmp_path, overrides, expected):
    folder = _save(tmp_path, "hf", **overrides)
    with pytest.raises(ConfigError, match=expected):
        checkpoint_hf.load_hf_([_ours()], Qwen3StateDictAdapter(ARGS), folder)


# Qwen3's MoE sizes: the published config.json (hidden_size, intermediate_size,
# moe_intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# num_experts, num_experts_per_tok; norm_topk_prob true, untied) and the model cards' totals
# (total, activated, non-embedding), in billions.
PUBLISHED_MOE_CONFIGS = {
    "30B-A3B": ((2048, 6144, 768, 48, 32, 4, 128, 8), (30.5, 3.3, 29.9)),
    "235B-A22B": ((4096, 12288, 1536, 94, 64, 4, 128, 8), (235.0, 22.0, 234.0)),
}
MOE_ARGS = dataclasses.replace(flavors["debugmodel_moe"], n_layers=2, max_seq_len=64)


def _hf_moe_config(args):
    return transformers.Qwen3MoeConfig(
        hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
        moe_intermediate_size=args.moe_hidden_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, vocab_size=args.vocab_size, num_experts=args.moe.num_experts,
        num_experts_per_tok=args.moe.top_k, norm_topk_prob=True, rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.mark.parametrize("flavor", sorted(PUBLISHED_MOE_CONFIGS))
def test_moe_flavors_match_the_published_shapes_and_sizes(flavor):
    args = flavors[flavor]
    m = args.moe
    shape = (args.dim, args.ffn_hidden_dim, args.moe_hidden_dim, args.n_layers, args.n_heads,
             args.kv_heads, m.num_experts, m.top_k)  # fmt: skip
    published, (total, activated, non_embedding) = PUBLISHED_MOE_CONFIGS[flavor]
    assert shape == published
    assert (m.score_func, m.route_norm, m.num_shared_experts, m.route_scale) == (
        "softmax", True, 0, 1.0,
    )  # fmt: skip
    with torch.device("meta"):
        ours = sum(p.numel() for p in Transformer(args).parameters())
        theirs = transformers.Qwen3MoeForCausalLM(_hf_moe_config(args))
    assert ours == args.num_params() == sum(p.numel() for p in theirs.parameters())
    assert args.num_params() / 1e9 == pytest.approx(total, abs=0.6)  # "235B": rounded
    assert args.num_params(activated=True) / 1e9 == pytest.approx(activated, abs=0.2)
    embeddings = 2 * args.vocab_size * args.dim
    assert (args.num_params() - embeddings) / 1e9 == pytest.approx(non_embedding, abs=0.6)
    # Per token only top_k of the experts compute: FLOPs follow the activated weights.
    dense_flops = 6 * args.num_params(exclude_embedding=True)
    assert args.flops_per_token(4096) < dense_flops / 5


def _random_hf_moe(seed: int):
    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(_hf_moe_config(MOE_ARGS)).eval()
    with torch.no_grad():  # norms and routers random too: a swap or a transpose would show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "gate" in name and p.dim() == 2 and p.shape[0] == MOE_ARGS.moe.num_experts:
                p.normal_(0.0, 0.5)
    return hf


def test_moe_import_export_and_round_trip(tmp_path):
    hf = _random_hf_moe(3)
    hf.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(TOKENS).logits
    assert hf_config.hf_family(tmp_path / "hf") == "qwen3"
    ours = _ours(MOE_ARGS)
    adapter = Qwen3StateDictAdapter(MOE_ARGS)
    checkpoint_hf.load_hf_([ours], adapter, tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), want, rtol=1e-5, atol=1e-5)

    checkpoint_hf.save_hf(
        [ours], adapter, tmp_path / "out", dtype=torch.float32, writer=True, pipelined=False
    )
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"])
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, want, rtol=1e-5, atol=1e-5)
    original, exported = (checkpoint_hf.read_tensors(tmp_path / d) for d in ("hf", "out"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_a_learned_routing_bias_is_not_exported_silently(tmp_path):
    """Qwen3MoeForCausalLM routes without a bias: dropping a moved one would change which
    experts every token picks."""
    ours = _ours(MOE_ARGS)
    adapter = Qwen3StateDictAdapter(MOE_ARGS)
    checkpoint_hf.save_hf(  # a zero bias is HF's implicit one
        [ours], adapter, tmp_path / "zero", dtype=torch.float32, writer=True, pipelined=False
    )
    with torch.no_grad():
        ours.layers["1"].moe.expert_bias[3] = 0.01
    with pytest.raises(
        ConfigError, match=r"layers\.1\.moe\.expert_bias is not zero .*--moe\.load_balance_coeff 0"
    ):
        checkpoint_hf.save_hf(
            [ours], adapter, tmp_path / "out", dtype=torch.float32, writer=True, pipelined=False
        )
    assert not (tmp_path / "out").exists()


def test_moe_folders_and_flavors_do_not_cross(tmp_path):
    from torchtitan.models.spec import get_model_spec

    full = dataclasses.replace(flavors["debugmodel_moe"], max_seq_len=64)
    transformers.Qwen3MoeForCausalLM(_hf_moe_config(full)).save_pretrained(tmp_path / "full")
    assert hf_config.matching_flavor(get_model_spec("qwen3"), tmp_path / "full") == (
        "debugmodel_moe"
    )
    _random_hf_moe(4).save_pretrained(tmp_path / "moe")
    dense = _save(tmp_path, "dense")
    with pytest.raises(ConfigError, match="model_type 'qwen3_moe' is not 'qwen3'"):
        checkpoint_hf.load_hf_([_ours()], Qwen3StateDictAdapter(ARGS), tmp_path / "moe")
    with pytest.raises(ConfigError, match="model_type 'qwen3' is not 'qwen3_moe'"):
        checkpoint_hf.load_hf_([_ours(MOE_ARGS)], Qwen3StateDictAdapter(MOE_ARGS), dense)
    config = json.loads((tmp_path / "moe/config.json").read_text())
    (tmp_path / "moe/config.json").write_text(json.dumps(config | {"mlp_only_layers": [1]}))
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[1\] \(flavor: \[\]\)"):
        checkpoint_hf.load_hf_([_ours(MOE_ARGS)], Qwen3StateDictAdapter(MOE_ARGS), tmp_path / "moe")


def test_sampling_from_a_checkpoint_routes_with_its_expert_bias(tmp_path):
    """The routing bias is a buffer, not a parameter: a DCP checkpoint's is loaded too."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.checkpoint_states import ModelState
    from torchtitan.config.job_config import Checkpoint
    from torchtitan.generate import load_model

    args = dataclasses.replace(flavors["debugmodel_moe"], max_seq_len=64)
    trained = _ours(args)
    with torch.no_grad():  # a bias that moves tokens to other experts
        for block in trained.layers.values():
            block.moe.expert_bias.copy_(torch.linspace(-0.5, 0.5, args.moe.num_experts))
    manager = CheckpointManager(
        Checkpoint(enable=True, folder="checkpoint"), dump_folder=str(tmp_path),
        states={"model": ModelState([trained])}, device_type="cpu",
        run_config='[model]\nname = "qwen3"\nflavor = "debugmodel_moe"\n',
    )  # fmt: skip
    manager.save(1, model_only=True)
    model, _, _ = load_model(tmp_path, None, None, torch.device("cpu"))
    assert torch.equal(model.layers["0"].moe.expert_bias, trained.layers["0"].moe.expert_bias)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), trained(TOKENS), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"use_sliding_window": True},
            "use_sliding_window=True .* is not what this --model.flavor computes",
        ),
        (
            {"attention_bias": True},
            "attention_bias=True .* is not what this --model.flavor computes",
        ),
        ({"hidden_act": "gelu"}, "hidden_act=gelu .* is not what this --model.flavor computes"),
        ({"norm_topk_prob": None}, r"norm_topk_prob=False \(flavor: True\)"),  # HF's default
        ({"mlp_only_layers": None}, None),  # HF reads null as no dense layer
    ],
)
def test_moe_folders_that_compute_otherwise_are_refused(tmp_path, overrides, expected):
    _random_hf_moe(5).save_pretrained(tmp_path / "moe")
    config = json.loads((tmp_path / "moe/config.json").read_text())
    (tmp_path / "moe/config.json").write_text(json.dumps(config | overrides))
    adapter, ours = Qwen3StateDictAdapter(MOE_ARGS), _ours(MOE_ARGS)
    if expected is None:
        checkpoint_hf.load_hf_([ours], adapter, tmp_path / "moe")
        return
    with pytest.raises(ConfigError, match=expected):
        checkpoint_hf.load_hf_([ours], adapter, tmp_path / "moe")


def test_a_run_exporting_over_another_runs_export_moves_it_aside(tmp_path):
    """The trainer's ``hf-step-N`` export, where another run left one: kept, renamed, as
    checkpoints are; the new export is whole (no old shard mixed in)."""
    ours = _ours(MOE_ARGS)
    hfio = checkpoint_hf.HFIO([ours], Qwen3StateDictAdapter(MOE_ARGS), writer=True, pipelined=False)
    folder = tmp_path / "hf-step-3"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"another run's")
    hfio.save(folder, torch.float32)
    assert (tmp_path / "hf-step-3.replaced/model.safetensors").read_bytes() == b"another run's"
    assert not (folder / "model.safetensors").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, ours(TOKENS), rtol=1e-5, atol=1e-5)

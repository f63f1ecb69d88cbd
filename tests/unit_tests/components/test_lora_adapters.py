"""LoRA adapters on one process: which layers get them, what trains, how they start, how they
follow a layer's tensor-parallel placement, and how they fold into plain weights."""

import dataclasses
import json

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from torchtitan.components import lora
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import LoRA
from torchtitan.models.spec import get_model_spec


def _model(module: str = "llama3", flavor: str = "debugmodel", config: LoRA | None = None):
    spec = get_model_spec(module)
    args = spec.args_for(flavor, seq_len=32)
    with torch.device("meta"):
        model = spec.build_model(args)
    if config is not None:
        lora.add_adapters(model, config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    if config is not None:
        lora.init_adapters(model)
    return model


def _adapted(model) -> list[str]:
    return [n for n, m in model.named_modules() if lora.is_adapted(m)]


def test_default_targets_are_the_blocks_linear_layers_but_not_routers_or_the_output():
    model = _model(config=LoRA(rank=4))
    names = _adapted(model)
    assert len(names) == 6 * 7 and "output" not in names
    assert {n.split(".", 2)[2] for n in names} == {
        "attention.wq", "attention.wk", "attention.wv", "attention.wo",
        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
    }  # fmt: skip
    moe = _model("qwen3", "debugmodel_moe", LoRA(rank=4))
    assert _adapted(moe) and not any("router" in n for n in _adapted(moe))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{a}" for n in names for a in ("lora_a", "lora_b")}
    wq = model.layers["0"].attention.wq
    assert wq.lora_a.shape == (4, wq.in_features) and wq.lora_b.shape == (wq.out_features, 4)


def test_targets_by_name_suffix_and_comma_lists_and_an_unknown_name_is_refused():
    model = _model(config=LoRA(rank=2, target_modules=["wq,attention.wo", "output"]))
    suffixes = {n.rsplit(".", 1)[-1] for n in _adapted(model)}
    assert suffixes == {"wq", "wo", "output"} and len(_adapted(model)) == 13
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        meta = spec.build_model(spec.flavors["debugmodel"])
    with pytest.raises(ConfigError) as info:
        lora.targets(meta, LoRA(rank=2, target_modules=["q_proj"]))
    message = str(info.value)
    assert "--lora.target_modules q_proj" in message and "attention.wq" in message
    assert "\n" not in message


def test_the_adapted_model_starts_as_the_frozen_one_and_merges_into_plain_weights():
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    plain, adapted = _model(), _model(config=LoRA(rank=4, alpha=8.0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(tokens), plain(tokens), rtol=0, atol=0)
        for module in adapted.modules():
            if lora.is_adapted(module):
                bound = 1 / module.in_features**0.5  # a linear layer's default init
                assert module.lora_b.eq(0).all() and 0 < module.lora_a.abs().max() <= bound
                module.lora_b.normal_(std=0.02)
        changed = adapted(tokens)
        assert not torch.allclose(changed, plain(tokens), atol=1e-3)
        merged = lora.merge_state_dict(adapted.state_dict(), scale=8.0 / 4)
        plain.load_state_dict(merged)  # strict: exactly the plain model's names
        torch.testing.assert_close(plain(tokens), changed, rtol=1e-5, atol=1e-5)


def test_only_the_adapters_get_gradients():
    model = _model(config=LoRA(rank=4))
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens).sum().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(lora.is_adapter_name(n) for n in with_grad)
    # B is zero at first, so A's gradient is too; B's is not.
    assert model.layers["0"].attention.wq.lora_b.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("weight", "a", "b"),
    [
        (Shard(0), Replicate(), Shard(0)),  # column-parallel: B split with the outputs
        (Shard(1), Shard(1), Replicate()),  # row-parallel: A split with the inputs
        (Replicate(), Replicate(), Replicate()),
    ],
)
def test_adapters_follow_the_weights_tensor_parallel_placement(weight, a, b):
    assert lora._adapter_placement(weight, "lora_a") == a
    assert lora._adapter_placement(weight, "lora_b") == b


def test_a_placement_adapters_cannot_follow_is_refused():
    with pytest.raises(ConfigError, match="leave that layer out of --lora.target_modules"):
        lora._adapter_placement(Partial(), "lora_a")


def test_merging_needs_the_scale_and_leaves_states_without_adapters_alone():
    state = {
        "w.weight": torch.ones(2, 2),
        "w.lora_a": torch.ones(1, 2),
        "w.lora_b": torch.ones(2, 1),
    }
    with pytest.raises(ConfigError, match="no \\[lora\\] rank"):
        lora.merge_state_dict(state, None)
    merged = lora.merge_state_dict(state, 0.5)
    assert merged.keys() == {"w.weight"} and merged["w.weight"].eq(1.5).all()
    plain = {"w.weight": torch.ones(2, 2)}
    assert lora.merge_state_dict(plain, None) is plain
    assert lora.scale_of({"rank": 8, "alpha": 16.0}) == 2.0 and lora.scale_of({"rank": 0}) is None
    assert lora.scale_of(None) is None and lora.scale_of(dataclasses.replace(LoRA(), rank=4)) == 4.0


def test_rank_zero_changes_nothing():
    model = _model(config=LoRA(rank=0))
    assert not _adapted(model) and all(p.requires_grad for p in model.parameters())


def test_a_family_whose_parallelize_adds_no_adapters_is_refused():
    from torch import nn

    part = nn.Module()
    part.layers = nn.ModuleDict({"0": nn.Linear(4, 4)})
    lora.check_added(part, LoRA(rank=0), "toy")  # LoRA off: nothing to check
    with pytest.raises(ConfigError, match="model toy's parallelize adds no LoRA adapters"):
        lora.check_added(part, LoRA(rank=2), "toy")
    lora.add_adapters(part, LoRA(rank=2))
    lora.check_added(part, LoRA(rank=2), "toy")


def test_a_tied_output_projection_cannot_take_an_adapter():
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        tied = spec.build_model(spec.flavors["1B"])  # output shares the embedding table
    with pytest.raises(ConfigError, match="output shares its weight with another module"):
        lora.targets(tied, LoRA(rank=2, target_modules=["output"]))
    assert len(lora.targets(tied, LoRA(rank=2))) == 16 * 7  # the blocks' layers are fine


def test_an_adapted_float8_linear_is_still_a_float8_linear():
    from torch import nn

    from torchtitan.components import float8

    class Float8Linear(nn.Linear):  # what float8.is_float8 recognises torchao's class by
        pass

    model = nn.Module()
    model.layers = nn.ModuleDict({"0": Float8Linear(4, 4)})
    lora.add_adapters(model, LoRA(rank=2))
    assert lora.is_adapted(model.layers["0"]) and float8.is_float8(model.layers["0"])


def test_a_pipeline_stage_without_adapters_is_refused():
    """``--lora.target_modules output`` under PP leaves the first stage nothing to train."""
    config = LoRA(rank=2, target_modules=["output"])
    model = _model(config=config)
    model.output = None  # the first stage of two
    with pytest.raises(
        ConfigError,
        match="the pipeline stage of tok_embeddings, layers.0, layers.1, .*, norm has no layer",
    ):
        lora.check_added(model, config, "llama3")


def test_a_tied_output_projection_counts_as_frozen_under_its_own_name():
    """Adapter-only saves leave out every frozen name a state dict has, the tied
    ``output.weight`` (the embedding table again) included."""
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        tied = spec.build_model(spec.flavors["1B"])
    lora.add_adapters(tied, LoRA(rank=2))
    names = lora.frozen_names([tied])
    assert {"output.weight", "tok_embeddings.weight"} <= names
    assert not any(lora.is_adapter_name(n) for n in names)


def _export(model, module: str, tmp_path, caplog):
    from torchtitan.components import checkpoint_hf

    spec = get_model_spec(module)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):  # B starts at zero: give the adapters an effect
                p.normal_(std=0.02)
    checkpoint_hf.save_hf(
        [model], spec.state_dict_adapter(spec.args_for("debugmodel", seq_len=32)),
        tmp_path / "hf", dtype=torch.float32, writer=True, pipelined=False,
        peft_folder=tmp_path / "peft", base_model=str(tmp_path / "base"),
    )  # fmt: skip
    return tmp_path / "peft"


def test_moe_ffn_adapters_have_no_peft_form_and_attention_ones_do(tmp_path, caplog):
    """peft moves gate/up/down_proj targets of DeepSeek-V3 (and Qwen3-MoE) models onto their
    routed experts: adapters on dense FFN layers or shared experts would not apply. Such an
    export writes the merged model and no PEFT folder; attention adapters alone get one."""
    whole = _model("deepseek_v3", config=LoRA(rank=4))
    peft = _export(whole, "deepseek_v3", tmp_path / "all", caplog)
    assert not peft.exists() and (tmp_path / "all/hf/config.json").is_file()
    assert "not written in PEFT's format" in caplog.text and "routed experts" in caplog.text
    attention = _model("deepseek_v3", config=LoRA(rank=4, target_modules=["attention.wo"]))
    peft = _export(attention, "deepseek_v3", tmp_path / "attn", caplog)
    config = json.loads((peft / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "attn/base")
    assert all(t.endswith("self_attn.o_proj") for t in config["target_modules"])

"""``--optimizer.param_groups``: parameters matched by a regex train with their own LR scale,
weight decay, betas and eps (first match wins), through the schedule and across resumes."""

import copy

import pytest
import torch
from torch import nn

from torchtitan.components import lora
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import (
    build_optimizers,
    changed_settings_note,
    check_param_groups,
)
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, LoRA, LRScheduler, Optimizer
from torchtitan.config.validation import validate

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.LayerNorm(4)
        self.wq = nn.Linear(4, 4)


class Tiny(nn.Module):
    """Names as our models have them: ``tok_embeddings.weight``, ``layers.0.wq.bias``..."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(8, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.output = nn.Linear(4, 8, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block.wq(block.attention_norm(h))
        return self.output(h)


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.arange(8).reshape(2, 4)).logsumexp(-1).mean()


def _train(model, optimizer_config, steps=3, warmup=2):
    optimizers = build_optimizers([model], optimizer_config, CPU)
    schedulers = build_lr_schedulers(
        optimizers, LRScheduler(warmup_steps=warmup), training_steps=10
    )
    for _ in range(steps):
        optimizers.zero_grad()
        _loss(model).backward()
        optimizers.step()
        schedulers.step()
    return optimizers, schedulers


def test_entries_parse_with_the_sections_settings_as_defaults():
    config = Optimizer(
        weight_decay=0.05,
        param_groups=["norm|bias:weight_decay=0", "(?:tok):lr_scale=0.1,beta2=0.99"],
    )
    first, second = config.groups()
    assert (first.pattern, first.lr_scale, first.weight_decay, first.beta2) == (
        "norm|bias", 1.0, 0.0, 0.95,
    )  # fmt: skip
    assert (second.pattern, second.lr_scale, second.weight_decay, second.beta2) == (
        "(?:tok)", 0.1, 0.05, 0.99,
    )  # fmt: skip


@pytest.mark.parametrize(
    "entry, message",
    [
        ("norm", "is not REGEX:key=value"),
        ("norm:wd=0", "'wd=0' is not key=value with a key of lr_scale"),
        ("norm:weight_decay=x", "weight_decay=x is not a number"),
        ("(:lr_scale=1", "the regex does not compile"),
        ("norm:beta1=1", "beta1 and beta2 must be in [0, 1)"),
        ("norm:lr_scale=-1", "lr_scale must be >= 0"),
        ("norm:eps=0", "eps must be > 0"),
        ("norm:lr_scale=nan", "lr_scale must be >= 0 and finite"),
    ],
)
def test_a_bad_entry_is_refused_before_launch_naming_the_flag(entry, message):
    config = JobConfig()
    config.optimizer.param_groups = [entry]
    with pytest.raises(ConfigError, match="^--optimizer.param_groups ") as error:
        validate(config)
    assert message in str(error.value)


def test_groups_train_exactly_as_hand_built_adamw_groups():
    """First match wins; unmatched parameters keep the section's settings; every group's LR
    follows the schedule times its scale."""
    torch.manual_seed(0)
    model = Tiny()
    reference = copy.deepcopy(model)
    config = Optimizer(
        lr=0.01,
        weight_decay=0.1,
        param_groups=[
            "norm:lr_scale=0",
            "tok_embeddings|layers.1:lr_scale=0.5,weight_decay=0,beta1=0.8",
        ],
    )
    optimizers, schedulers = _train(model, config)

    def named(*names):
        return [p for n, p in reference.named_parameters() if n in names]

    norms = [n for n, _ in reference.named_parameters() if "norm" in n]
    second = ["tok_embeddings.weight", "layers.1.wq.weight", "layers.1.wq.bias"]
    rest = ["layers.0.wq.weight", "layers.0.wq.bias", "output.weight"]
    hand = torch.optim.AdamW(
        [
            {"params": named(*norms), "lr": 0.0},
            {"params": named(*second), "lr": 0.005, "weight_decay": 0.0, "betas": (0.8, 0.95)},
            {"params": named(*rest)},
        ],
        lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True,
    )  # fmt: skip
    hand_schedule = torch.optim.lr_scheduler.LambdaLR(hand, schedulers.schedulers[0].lr_lambdas[0])
    for _ in range(3):
        hand.zero_grad()
        _loss(reference).backward()
        hand.step()
        hand_schedule.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
    for name, p in Tiny().named_parameters():  # the norms never moved (a zero LR)
        if "norm" in name:
            assert torch.equal(dict(model.named_parameters())[name], p), name
    lrs = [g["lr"] for g in optimizers.optimizers[0].param_groups]
    factor = schedulers.factor()
    assert lrs == [0.0, 0.01 * 0.5 * factor, 0.01 * factor]
    assert factor == hand_schedule.lr_lambdas[0](3)


def test_a_resume_applies_this_runs_settings_to_the_loaded_moments():
    """The checkpoint stores the saving run's settings with every parameter; a run resumed
    with other groups (or none) takes its own, LR scales included, and keeps the moments."""
    torch.manual_seed(0)
    model = Tiny()
    saved_optimizers, saved_schedulers = _train(copy.deepcopy(model), Optimizer(lr=0.01))
    state = copy.deepcopy(saved_optimizers.state_dict())

    config = Optimizer(lr=0.02, param_groups=["norm:weight_decay=0,lr_scale=0.25"])
    optimizers = build_optimizers([model], config, CPU)
    schedulers = build_lr_schedulers(optimizers, LRScheduler(warmup_steps=2), training_steps=10)
    optimizers.load_state_dict(state)
    schedulers.load_state_dict(copy.deepcopy(saved_schedulers.state_dict()))
    schedulers.reapply(config.lr)
    norm_group, rest_group = optimizers.optimizers[0].param_groups
    assert norm_group["weight_decay"] == 0.0 and rest_group["weight_decay"] == 0.1
    factor = schedulers.factor()
    assert norm_group["lr"] == 0.02 * 0.25 * factor and rest_group["lr"] == 0.02 * factor
    moments = {k: v for k, v in optimizers.state_dict().items() if k.startswith("state.")}
    for key, value in moments.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(state[key])), key

    # And back: grouped moments load into an ungrouped run.
    plain = build_optimizers([Tiny()], Optimizer(lr=0.01), CPU)
    plain.load_state_dict(copy.deepcopy(optimizers.state_dict()))
    assert [g["weight_decay"] for g in plain.optimizers[0].param_groups] == [0.1]


def test_an_entry_no_trainable_parameter_takes_is_refused():
    model = Tiny()
    check_param_groups(model, Optimizer(param_groups=["norm:weight_decay=0"]))
    with pytest.raises(ConfigError, match="'nrom:weight_decay=0': no trainable parameter"):
        check_param_groups(model, Optimizer(param_groups=["nrom:weight_decay=0"]))
    # Every norm is taken by the first entry: the second would change nothing.
    shadowed = Optimizer(param_groups=["norm|wq:lr_scale=2", "attention_norm:weight_decay=0"])
    with pytest.raises(ConfigError, match="'attention_norm:weight_decay=0'"):
        check_param_groups(model, shadowed)
    # Under LoRA only the adapters train: the frozen norms are nothing to group.
    adapted = lora.add_adapters(Tiny(), LoRA(rank=2, target_modules=["wq"]))
    check_param_groups(adapted, Optimizer(param_groups=["lora_b:lr_scale=4"]))
    with pytest.raises(ConfigError, match="no trainable parameter"):
        check_param_groups(adapted, Optimizer(param_groups=["norm:weight_decay=0"]))


def test_the_resume_note_names_changed_settings_only():
    saved = Optimizer()
    assert changed_settings_note(Optimizer(), saved) is None
    assert changed_settings_note(Optimizer(), None) is None
    note = changed_settings_note(
        Optimizer(weight_decay=0.0, param_groups=["norm:lr_scale=0"]), saved
    )
    assert "--optimizer.weight_decay 0.1 -> 0.0" in note
    assert "--optimizer.param_groups [] -> ['norm:lr_scale=0']" in note
    assert "beta1" not in note


def test_stages_with_different_groups_resume_their_schedules():
    """A rank holding two pipeline stages, the first with more param groups than the second:
    the one saved schedule state loads into both (it holds the first's per-group values)."""
    model = Tiny()
    first, second = nn.Module(), nn.Module()
    first.tok_embeddings, first.layers = model.tok_embeddings, model.layers
    second.output = model.output
    config = Optimizer(param_groups=["tok_embeddings:lr_scale=0.1"])
    optimizers = build_optimizers([first, second], config, CPU)
    assert [len(o.param_groups) for o in optimizers.optimizers] == [2, 1]
    schedulers = build_lr_schedulers(optimizers, LRScheduler(warmup_steps=2), training_steps=10)
    for _ in range(3):
        schedulers.step()
    state = copy.deepcopy(schedulers.state_dict())
    resumed = build_lr_schedulers(
        build_optimizers([first, second], config, CPU),
        LRScheduler(warmup_steps=2),
        training_steps=10,
    )
    resumed.load_state_dict(state)
    resumed.reapply(config.lr)
    assert [s.get_last_lr() for s in resumed.schedulers] == [
        s.get_last_lr() for s in schedulers.schedulers
    ]


def test_a_resume_keeps_this_runs_optimizer_and_kernel():
    """Adam after AdamW, foreach after fused: the loaded groups do not bring the saving run's
    decoupled weight decay or kernel back."""
    model = Tiny()
    saved, _ = _train(model, Optimizer(name="AdamW", implementation="fused"), steps=1)
    resumed = build_optimizers([model], Optimizer(name="Adam", implementation="foreach"), CPU)
    resumed.load_state_dict(copy.deepcopy(saved.state_dict()))
    (group,) = resumed.optimizers[0].param_groups
    assert not group["decoupled_weight_decay"] and group["foreach"] and not group["fused"]


@pytest.mark.parametrize(
    "entry, message",
    [
        ("norm:lr_scale=1,lr_scale=2", "lr_scale is given twice"),
        ("a{99999999999}:lr_scale=1", "the regex does not compile"),
    ],
)
def test_more_bad_entries(entry, message):
    with pytest.raises(ValueError, match=message):
        Optimizer(param_groups=[entry]).groups()
    assert Optimizer(param_groups=["norm: lr_scale = 2 "]).groups()[0].lr_scale == 2.0

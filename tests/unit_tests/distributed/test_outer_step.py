"""``distributed/semi_sync.py`` in one process: which fragment meets when, the outer step
against ``torch.optim.SGD``, and the checkpoint state (each replica's own weights, the outer
momentum, the synced model). Real replicas: ``tests/integration_tests/test_semi_sync.py``."""

import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

from torchtitan.components import checkpoint_states
from torchtitan.components.checkpoint_states import (
    ModelState,
    SyncedModelState,
    match_semi_sync_layout,
)
from torchtitan.components.optimizer import Optimizers
from torchtitan.config.errors import ConfigError
from torchtitan.config.execution import SemiSync as SemiSyncConfig
from torchtitan.config.manager import parse_args
from torchtitan.distributed.semi_sync import SemiSync, fragment_of, sync_offset


class _Tiny(nn.Module):
    """Named as the families' models are: an embedding, blocks under ``layers``, an output
    tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(5, 3)
        self.layers = nn.ModuleDict({str(i): nn.Linear(3, 3) for i in range(4)})
        self.norm = nn.LayerNorm(3)
        self.output = nn.Linear(3, 5, bias=False)
        self.output.weight = self.tok_embeddings.weight


def _semi(model: nn.Module, **settings) -> SemiSync:
    config = SemiSyncConfig(**({"method": "diloco"} | settings))
    return SemiSync(config, [model], group=None, replica=0, replicas=1, n_layers=4)


def _train(model: nn.Module, seed: int) -> None:
    """Some change to every weight (an inner step's stand-in)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.01)


def test_fragments_are_consecutive_blocks_with_the_embedding_first_and_the_output_last():
    assert [fragment_of(f"layers.{i}.weight", 2, 4) for i in range(4)] == [0, 0, 1, 1]
    assert fragment_of("tok_embeddings.weight", 2, 4) == 0
    assert fragment_of("norm.weight", 2, 4) == fragment_of("output.weight", 2, 4) == 1
    assert fragment_of("layers.3.attention.wq.weight", 1, 4) == 0


@pytest.mark.parametrize(
    ("fragments", "sync_steps", "offsets"),
    [(1, 5, [0]), (2, 4, [2, 0]), (3, 3, [1, 2, 0]), (4, 8, [2, 4, 6, 0])],
)
def test_fragments_meet_evenly_spread_the_last_at_multiples(fragments, sync_steps, offsets):
    assert [sync_offset(f, fragments, sync_steps) for f in range(fragments)] == offsets
    semi = _semi(_Tiny(), num_fragments=fragments, sync_steps=sync_steps)
    met = [step for step in range(1, 2 * sync_steps + 1) if semi.due(step)]
    assert len(met) == 2 * fragments  # each fragment twice in two periods, never two at once
    assert all(len(semi.due(step)) == 1 for step in met)
    for step in range(3 * sync_steps):  # the meetings' count, as logged (also after a resume)
        assert semi.meetings_through(step) == sum(1 for t in range(1, step + 1) if semi.due(t))


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_outer_step_is_sgd_on_the_pseudo_gradient(nesterov: bool):
    """Three meetings of one replica: the synced weights move as ``torch.optim.SGD`` moves them
    with the pseudo-gradient (synced - own) as gradient, bitwise; the model takes them; a
    tied weight is one weight."""
    model, reference = _Tiny(), _Tiny()
    reference.load_state_dict(model.state_dict())
    semi = _semi(model, sync_steps=2, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=nesterov)
    semi.start()
    assert len(semi.weights) == len(list(model.parameters()))  # the tied output counted once
    synced = {n: p.detach().clone() for n, p in reference.named_parameters()}
    outer = torch.optim.SGD(list(synced.values()), lr=0.7, momentum=0.9, nesterov=nesterov)
    for step in range(1, 7):
        _train(model, step)
        _train(reference, step)
        assert semi.after_step(step) == (step % 2 == 0)
        if step % 2 == 0:
            own = dict(reference.named_parameters())
            for n, s in synced.items():
                s.grad = s - own[n].detach()
            outer.step()
            with torch.no_grad():
                for n, s in synced.items():
                    own[n].copy_(s)
        for (name, mine), theirs in zip(
            model.named_parameters(), reference.parameters(), strict=True
        ):
            assert torch.equal(mine, theirs), (step, name)
    assert semi.metrics(6)["semi_sync_syncs"] == 3
    assert semi.metrics(6)["semi_sync_pseudo_grad_norm"] > 0


def test_local_sgd_takes_the_mean_and_saves_no_momentum():
    """One replica of two whose all-reduce is stood in for: the weights become the mean of
    its own and the other's, the synced weights too; the pseudo-gradient norm is that of the
    change; the checkpoint state holds its own weights only."""
    model = _Tiny()
    semi = _semi(model, method="local_sgd", sync_steps=1)
    semi.replicas, semi.group = 2, object()
    other = [torch.full_like(p, 0.5) for p in model.parameters()]
    calls = []

    def all_reduce(flat, group):  # this replica's weights plus the other's
        calls.append(group)
        flat.add_(torch.cat([t.reshape(-1) for t in other]))

    semi.start()
    _train(model, 0)
    own = [p.detach().clone() for p in model.parameters()]
    before = [s.clone() for s in semi.synced]
    import torchtitan.distributed.semi_sync as module

    original, module.dist.all_reduce = module.dist.all_reduce, all_reduce
    try:
        semi.after_step(1)
    finally:
        module.dist.all_reduce = original
    assert calls == [semi.group]
    for o, t, s, p in zip(own, other, semi.synced, model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), (o + t) / 2, rtol=0, atol=0)
        assert torch.equal(s, p.detach())
    moved = torch.cat([(b - s).reshape(-1) for b, s in zip(before, semi.synced, strict=True)])
    torch.testing.assert_close(semi.last_norm, moved.norm())
    assert {k.split(".", 1)[0] for k in semi.state_dict()} == {"replica0"}


def test_mixing_keeps_alpha_of_the_replicas_own_weights():
    model = _Tiny()
    semi = _semi(model, sync_steps=1, outer_momentum=0.0, fragment_update_alpha=0.25)
    semi.start()
    _train(model, 0)
    own = [p.detach().clone() for p in model.parameters()]
    semi.after_step(1)
    for o, s, p in zip(own, semi.synced, model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), 0.25 * o + 0.75 * s)


def test_a_meeting_runs_the_hooks_around_its_change_of_the_weights():
    """``before_change`` (a checkpoint's staging copy finished) sees the replica's own weights,
    ``after_change`` (float8's weight scales recomputed: ``Optimizers.weights_changed``) the
    met ones; steps without a meeting call neither. A float8 run cannot show a stale scale
    (its rounding hides it: ``docs/semi_sync.md``), so the contract is pinned here."""
    model = _Tiny()
    seen: list[tuple[str, torch.Tensor]] = []
    weight = model.layers["0"].weight
    config = SemiSyncConfig(method="diloco", sync_steps=2, outer_momentum=0.0)
    semi = SemiSync(
        config, [model], group=None, replica=0, replicas=1, n_layers=4,
        before_change=lambda: seen.append(("before", weight.detach().clone())),
        after_change=lambda: seen.append(("after", weight.detach().clone())),
    )  # fmt: skip
    semi.start()
    _train(model, 0)
    own = weight.detach().clone()
    assert not semi.after_step(1) and seen == []
    assert semi.after_step(2)
    assert [what for what, _ in seen] == ["before", "after"]
    assert torch.equal(seen[0][1], own)
    assert not torch.equal(seen[1][1], own) and torch.equal(seen[1][1], weight.detach())
    assert not semi.after_step(3) and len(seen) == 2


def test_the_checkpoint_holds_the_synced_model_and_each_replicas_own_weights():
    """A save between meetings: ``model`` is the synced weights (under every tied name),
    ``semi_sync`` this replica's own and the outer momentum. A run built afresh loads them
    (DCP reads into the tensors ``state_dict()`` handed out) and resumes with the same own
    weights, synced weights and momentum."""
    model = _Tiny()
    semi = _semi(model, sync_steps=2)
    semi.start()
    for step in (1, 2, 3):
        _train(model, step)
        semi.after_step(step)
    saved_model = SyncedModelState(ModelState([model]), semi.synced_view).state_dict()
    for name, value in saved_model.items():
        if name.endswith("weight") and "norm" not in name and name.startswith("layers.0"):
            assert torch.equal(value, semi.synced[[w.names[0] for w in semi.weights].index(name)])
    assert torch.equal(saved_model["output.weight"], saved_model["tok_embeddings.weight"])
    assert not torch.equal(saved_model["layers.0.weight"], model.layers["0"].weight)
    saved = {k: v.clone() for k, v in semi.state_dict().items()}
    assert {k.split(".", 1)[0] for k in saved} == {"replica0", "momentum"}
    assert "replica0.output.weight" not in saved  # the tied weight once, by its first name

    fresh = _Tiny()
    again = _semi(fresh, sync_steps=2)
    requested = SyncedModelState(ModelState([fresh]), again.synced_view)
    loading = requested.state_dict()  # before start(): the live weights, loaded into
    with torch.no_grad():
        for name, value in loading.items():
            value.copy_(saved_model[name])
        for name, value in again.state_dict().items():
            value.copy_(saved[name])
    again.load_state_dict({})
    again.start()
    for mine, theirs in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(again.synced, semi.synced, strict=True):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(again.momentum, semi.momentum, strict=True):
        assert torch.equal(mine, theirs)


def test_adapters_only_saves_keep_the_synced_view():
    model = _Tiny()
    semi = _semi(model)
    state = SyncedModelState(ModelState([model]), semi.synced_view).without({"norm.weight"})
    assert isinstance(state, SyncedModelState) and "norm.weight" not in state.state_dict()


def test_each_replicas_moments_are_saved_under_its_own_key():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    optimizers = Optimizers([model], [optimizer])
    flat = optimizers.state_dict()
    optimizers.replica_key = "replica1"
    nested = optimizers.state_dict()
    assert set(nested) == {"replica1"} and set(nested["replica1"]) == set(flat)
    optimizers.load_state_dict(nested)  # either form loads
    optimizers.load_state_dict(flat)


def test_checkpoints_of_the_other_kind_load_or_refuse_in_one_line(tmp_path: Path, monkeypatch):
    model = _Tiny()
    semi = _semi(model)
    optimizers = Optimizers([model], [torch.optim.AdamW(model.parameters())])
    optimizers.replica_key = "replica0"
    # An ordinary run's checkpoint: every replica starts from its weights and moments.
    wanted = {"model": ModelState([model]), "optimizer": optimizers, "semi_sync": semi}
    match_semi_sync_layout(tmp_path, wanted, {"model", "optimizer"}, semi)
    assert "semi_sync" not in wanted
    assert set(wanted["optimizer"].state_dict()) == set(optimizers.flat_state_dict())
    assert set(optimizers.state_dict()) == {"replica0"}  # (what it would have requested)
    # A semi-synchronous run's checkpoint resumed by an ordinary run: refused.
    wanted = {"model": ModelState([model]), "optimizer": optimizers}
    with pytest.raises(ConfigError, match="was saved by semi-synchronous training") as error:
        match_semi_sync_layout(tmp_path, wanted, {"model", "optimizer", "semi_sync"}, None)
    assert "\n" not in str(error.value)
    # ... unless it reads the weights alone.
    match_semi_sync_layout(tmp_path, {"model": wanted["model"]}, {"model", "semi_sync"}, None)
    # Another method's, or another number of replicas': refused.
    saved = {"model", "optimizer", "semi_sync"}
    for found, expected in (
        ((2, False), "was saved with --semi_sync.method local_sgd: resume with it"),
        ((2, True), "holds the weights of 2 semi-synchronous replicas, this run has 1"),
    ):
        monkeypatch.setattr(checkpoint_states, "saved_replicas", lambda path, found=found: found)
        wanted = {"model": ModelState([model]), "optimizer": optimizers, "semi_sync": semi}
        with pytest.raises(ConfigError, match=expected):
            match_semi_sync_layout(tmp_path, wanted, saved, semi)


def _refusal(flags: str) -> str:
    with pytest.raises(ConfigError) as error:
        parse_args(shlex.split(flags))
    return str(error.value)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            "--semi_sync.method diloco",
            "trains the replicas of --parallelism.data_parallel_replicate_degree apart: it is 1",
        ),
        (
            "--semi_sync.method diloco --parallelism.data_parallel_replicate_degree 2 "
            "--semi_sync.sync_steps 4 --semi_sync.num_fragments 3",
            "--semi_sync.num_fragments=3 must be >= 1 and divide --semi_sync.sync_steps=4",
        ),
        (
            "--semi_sync.method local_sgd --parallelism.data_parallel_replicate_degree 2 "
            "--semi_sync.sync_steps 4 --semi_sync.num_fragments 2",
            "is streaming DiLoCo's: use it with --semi_sync.method diloco",
        ),
        (
            "--semi_sync.method diloco --parallelism.data_parallel_replicate_degree 2 "
            "--semi_sync.outer_momentum 1",
            "--semi_sync.outer_momentum=1.0 in [0, 1)",
        ),
        (
            "--semi_sync.method diloco --parallelism.data_parallel_replicate_degree 2 "
            "--semi_sync.fragment_update_alpha 1",
            "--semi_sync.fragment_update_alpha=1.0 must be in [0, 1)",
        ),
        (
            "--semi_sync.method diloco --parallelism.data_parallel_replicate_degree 2 "
            "--parallelism.fsdp_impl simple",
            "needs FSDP2 and real ranks",
        ),
        ("--fault_tolerance.semi_sync_method diloco", "here it is --semi_sync.method"),
    ],
)
def test_semi_sync_flags_are_refused_before_launch_in_one_line(flags: str, expected: str):
    message = _refusal(flags)
    assert expected in message and "\n" not in message


def test_semi_sync_settings_without_a_method_are_named_as_ignored():
    from torchtitan.config.validation import ignored_settings

    config = parse_args(["--semi_sync.sync_steps", "5", "--semi_sync.no_outer_nesterov"])
    assert [n for n in ignored_settings(config) if "semi_sync" in n] == [
        "--semi_sync.sync_steps 5 is ignored without --semi_sync.method",
        "--semi_sync.outer_nesterov False is ignored without --semi_sync.method",
    ]

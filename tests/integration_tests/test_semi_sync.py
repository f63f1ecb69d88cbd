"""Semi-synchronous training (``--semi_sync``: LocalSGD, DiLoCo, streaming DiLoCo) trains as
its definition says: each case's real run (replicas of 1 or 2 ranks, FSDP, TP, PP or EP
inside them) against a one-process simulation of the same replicas on the same rows of the
same global batches, whose meetings are written with ``torch.optim.SGD``
(``semi_sync_reference.py``); a resume between two meetings continues bitwise; a checkpoint
of it refuses to resume as an ordinary run in one line."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import REPO, records, run_train

pytestmark = pytest.mark.integration

HARNESS = REPO / "tests/integration_tests/numerics_harness.py"
REFERENCE = REPO / "tests/integration_tests/semi_sync_reference.py"
BASE = (
    "--training.seq_len 32 --training.steps 6 --lr_scheduler.warmup_steps 2 --debug.seed 0 "
    "--debug.deterministic --metrics.log_freq 1"
)
SFT = (
    "--training.dataset chat_demo --training.data_format chat --model.attn_mask block_causal "
    "--training.seq_len 128"
)
MOE = "--module deepseek_v3 --config deepseek_v3_debugmodel"
# name: (ranks, the run's layout flags, rows per replica, the semi-synchronous settings,
# flags of the run and its reference alike)
CASES = {
    # Replicas of one rank each: the same kernels as one process, so bitwise.
    "diloco_ddp2": (2, "--training.local_batch_size 4", 4, dict(method="diloco", sync_steps=2)),
    "local_sgd_ddp2": (
        2,
        "--training.local_batch_size 4",
        4,
        dict(method="local_sgd", sync_steps=3),
    ),
    # FSDP inside each replica: the pseudo-gradients of sharded weights; answers-only
    # conversations, so each replica's gradient averages its own count of tokens (not the
    # global count's share).
    "diloco_fsdp2_sft": (
        4,
        "--training.local_batch_size 2 --parallelism.data_parallel_shard_degree 2",
        4,
        dict(method="diloco", sync_steps=3),
        SFT,
    ),
    # LoRA: only the adapters train, so only they meet.
    "diloco_lora_ddp2": (
        2,
        "--training.local_batch_size 4",
        4,
        dict(method="diloco", sync_steps=2),
        "--lora.rank 4 --lora.alpha 32",
    ),
    # Experts split over each replica's two FSDP ranks (DeepSeek-V3): the experts' shards meet
    # with their own replica's; the routing biases move every step by the counts of both
    # replicas (semi_sync.md), which the reference sums over its replicas.
    "local_sgd_ep2_moe": (
        4,
        "--training.local_batch_size 2 --parallelism.data_parallel_shard_degree 2 "
        "--parallelism.expert_parallel_degree 2",
        4,
        dict(method="local_sgd", sync_steps=2),
        MOE,
    ),
    # TP inside each replica (replicated norm weights among sharded matrices); 3 fragments
    # meeting in turn, one each step; plain outer momentum; each replica keeping a quarter of
    # its own weights.
    "streaming_tp2": (
        4,
        "--training.local_batch_size 4 --parallelism.tensor_parallel_degree 2",
        4,
        dict(
            method="diloco",
            sync_steps=3,
            num_fragments=3,
            outer_lr=0.9,
            outer_momentum=0.5,
            outer_nesterov=False,
            fragment_update_alpha=0.25,
        ),
    ),  # fmt: skip
    # Pipeline stages inside each replica, 2 fragments (one per stage): each stage's weights
    # meet over their own replica group, the pseudo-gradient norm summed over the stages.
    "streaming_pp2": (
        4,
        "--training.local_batch_size 4 --parallelism.pipeline_parallel_degree 2 "
        "--parallelism.pipeline_parallel_microbatch_size 2",
        4,
        dict(method="diloco", sync_steps=2, num_fragments=2),
    ),
}
DEFAULTS = dict(num_fragments=1, outer_lr=0.7, outer_momentum=0.9, fragment_update_alpha=0.0)


def _flags(settings: dict) -> str:
    out = []
    for key, value in settings.items():
        if value is False:
            out.append(f"--semi_sync.no_{key}")
        else:
            out.append(f"--semi_sync.{key} {value}")
    return " ".join(out)


def _run(cmd: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("semi_sync")
    reference = []
    for name, (_, _, rows, settings, *shared) in CASES.items():
        s = DEFAULTS | settings
        reference.append(
            dict(
                name=f"ref_{name}", flags=f"{BASE} {' '.join(shared)}", replicas=2, rows=rows, method=s["method"],
                sync_steps=s["sync_steps"], num_fragments=s["num_fragments"],
                outer_lr=s["outer_lr"], outer_momentum=s["outer_momentum"],
                nesterov=s.get("outer_nesterov", True), alpha=s["fragment_update_alpha"],
            )
        )  # fmt: skip
    _run([sys.executable, str(REFERENCE), str(out), json.dumps(reference)])
    for world in (2, 4):
        args = [
            f"{name}:{BASE} {' '.join(shared)} {layout} "
            f"--parallelism.data_parallel_replicate_degree 2 {_flags(settings)}"
            for name, (ranks, layout, _, settings, *shared) in CASES.items()
            if ranks == world
        ]
        _run([
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
            str(HARNESS), str(out), *args,
        ])  # fmt: skip
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_semi_sync_trains_as_its_one_process_simulation(results, case):
    got = torch.load(results / f"{case}.pt", weights_only=True)
    want = torch.load(results / f"ref_{case}.pt", weights_only=True)
    logged = {r["step"]: r for r in got["records"] if "loss" in r}
    assert sorted(logged) == sorted(want["loss"]) == list(range(1, 7))
    bitwise = CASES[case][0] == 2
    for step, record in logged.items():
        # loss: over both replicas' tokens; loss_local: rank 0's, replica 0's alone; grad_norm:
        # the replicas' own, combined (the one value where a gradient averaged over another
        # count of tokens shows: AdamW's steps hardly change with the gradient's scale).
        assert record["loss"] == pytest.approx(want["loss"][step], rel=1e-12 if bitwise else 1e-5)
        assert record["grad_norm"] == pytest.approx(want["grad_norm"][step], rel=1e-5), step
        if bitwise:
            assert record["loss_local"] == want["loss_local"][step], step
    # The replicas met: after the first meeting the losses are no longer the first step's
    # trained apart (a meeting that moved nothing would still match a run with none).
    settings = DEFAULTS | CASES[case][3]
    first_meeting = settings["sync_steps"] // settings["num_fragments"]
    assert logged[6]["semi_sync_syncs"] == 6 // first_meeting
    assert logged[6]["semi_sync_pseudo_grad_norm"] > 0
    if MOE in CASES[case][4:]:  # the routing biases moved and are compared too
        assert any(w.abs().sum() > 0 for n, w in want["weights"].items() if "expert_bias" in n)
    for name, weight in want["weights"].items():
        mine = got["weights"][name]
        if bitwise:
            assert torch.equal(mine, weight), name
        else:
            torch.testing.assert_close(mine, weight, rtol=0, atol=5e-5, msg=name)


STEPS = ["--training.steps", "8", "--lr_scheduler.warmup_steps", "2"]
REPLICAS = [
    "--parallelism.data_parallel_replicate_degree", "2",
    "--parallelism.data_parallel_shard_degree", "1",
    "--semi_sync.sync_steps", "3", "--checkpoint.enable", "--checkpoint.interval", "4",
]  # fmt: skip


@pytest.mark.parametrize("method", ["diloco", "local_sgd"])
def test_a_resume_between_meetings_is_bitwise(tmp_path: Path, method: str) -> None:
    """Saved at step 4, a step after a meeting: each replica's own weights and moments (and
    DiLoCo's outer momentum) are checkpointed beside the synced model, so steps 5-8 (a meeting
    at 6) resume bitwise. The checkpoint's model is the synced one, not replica 0's weights; an
    ordinary run refuses to resume it (its optimizer state is per replica), in one line, but
    validates its synced weights (``--validation.only``): checked once, for DiLoCo (another
    method's or replica count's refusal: ``test_outer_step.py``)."""
    flags = [*STEPS, *REPLICAS, "--semi_sync.method", method]
    whole = tmp_path / "whole"
    done = run_train(whole, *flags, ngpu=2)
    assert done.returncode == 0, done.stderr[-3000:]
    named = (
        "DiLoCo (outer SGD lr 0.7, Nesterov momentum 0.9)"
        if method == "diloco"
        else "LocalSGD (weights averaged)"
    )
    assert f"{named} over 2 replicas" in done.stderr
    want = {r["step"]: r["loss"] for r in records(whole) if "loss" in r}

    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoint/step-4", resumed / "checkpoint/step-4")
    again = run_train(resumed, *flags, ngpu=2)
    assert again.returncode == 0, again.stderr[-3000:]
    got = {r["step"]: r["loss"] for r in records(resumed) if "loss" in r}
    assert got == {s: want[s] for s in range(5, 9)}

    from torchtitan.components.checkpoint_files import read_full_model

    saved = read_full_model(whole / "checkpoint/step-4")
    replicas = read_full_model(whole / "checkpoint/step-4", state="semi_sync")
    own = {n.removeprefix("replica0."): t for n, t in replicas.items() if n.startswith("replica0.")}
    assert own and set(own) <= set(saved)
    assert any(not torch.equal(own[n], saved[n]) for n in own)  # trained apart since step 3

    if method != "diloco":
        return
    ordinary = tmp_path / "ordinary"
    shutil.copytree(whole / "checkpoint/step-4", ordinary / "checkpoint/step-4")
    refused = run_train(ordinary, *STEPS, "--checkpoint.enable", ngpu=1)
    assert refused.returncode == 2
    assert "was saved by semi-synchronous training" in refused.stderr
    assert "Traceback" not in refused.stderr
    validated = run_train(
        ordinary, *STEPS, "--checkpoint.enable", "--validation.enable", "--validation.only",
        "--validation.steps", "2", ngpu=1,
    )  # fmt: skip
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert records(ordinary / "validation_only.jsonl")[0]["step"] == 4

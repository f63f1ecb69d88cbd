"""Debugging tools on real CPU runs: hang dumps, collective tracing, profiling, memory
snapshots, non-finite steps, reproducibility."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import REPO, SMALL, clean_env, records, run_train

from torchtitan.tools.gc import GC_DEBUG_FOLDER

pytestmark = pytest.mark.integration
# Memory snapshots (or, on CPU, the memory timeline) of step 2.
SNAPSHOT = [
    "--training.steps", "2", "--profiling.enable_memory_snapshot",
    "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "0",
]  # fmt: skip


def _run_train(dump: Path, *flags: str, ngpu: int = 1, log_rank: str = "0"):
    return run_train(dump, *flags, ngpu=ngpu, log_rank=log_rank)


def test_a_hung_rank_ends_the_job_with_flight_recorder_and_stacks(tmp_path):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan.launcher", "--nproc_per_node", "2"]
        + ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
        + ["tests/integration_tests/hang_harness.py", *SMALL, "--training.steps", "6"]
        + ["--comm.train_timeout_seconds", "5", "--job.dump_folder", str(tmp_path)],
        cwd=REPO,
        env=clean_env(HANG_RANK="1", HANG_STEP="3"),
        capture_output=True,
        text=True,
        timeout=200,
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 120, "the job should end soon after the 5 s timeout, not after the sleep"
    out = result.stdout + result.stderr
    assert "Step 3 on rank 0 did not finish within 5 s" in out
    traces = tmp_path / "comm_traces"
    # The waiting rank's flight recorder names the collective it is stuck in.
    entries = json.loads((traces / "rank0_flight_recorder.json").read_text())["entries"]
    pending = [e for e in entries if e["state"] != "completed"]
    assert pending and pending[-1]["profiling_name"].startswith("gloo:")
    # The sleeping rank's stack dump shows where it is.
    assert "hang_harness.py" in (traces / "rank1_stacks.txt").read_text()
    assert (traces / "rank0_stacks.txt").exists()
    # The launcher reads both dumps together: who waited for whom, the one behind first.
    report = [line for line in out.splitlines() if line.startswith("[launcher] the hang: ")]
    assert report[0].startswith(
        "[launcher] the hang: rank 1 was outside any communication, at "
        "tests/integration_tests/hang_harness.py:"
    ), out[-3000:]
    assert report[1].startswith("[launcher] the hang: rank 0 waited in gloo:"), report
    assert report[1].endswith("which rank 1 never reached"), report
    assert "ChildFailedError" not in out and "Root Cause" not in out  # nothing torchrun adds


# A constant LR after warm-up: a 2-step run's schedule is the first 2 steps of a 4-step one.
LR = ["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant"]
FSDP_TP = ["--training.steps", "4", "--parallelism.tensor_parallel_degree", "2", *LR]


@pytest.fixture(scope="module")
def fsdp_tp_run(tmp_path_factory):
    """One real 4-rank FSDP 2 x TP 2 run, traced and profiled; also the reference losses of
    the local_tensor simulation."""
    dump = tmp_path_factory.mktemp("fsdp_tp")
    result = _run_train(
        dump,
        *FSDP_TP,
        "--debug.comm_trace_step",
        "2",
        "--debug.host_sync_step",
        "3",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.profiler_warmup",
        "0",
        "--training.gc_debug",
        ngpu=4,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dump, result.stdout + result.stderr


def test_fsdp_x_tp_steps_leave_no_tensor_in_a_reference_cycle(fsdp_tp_run):
    """Every step's garbage was looked at (--training.gc_debug): no tensor was held by a
    cycle, so each is freed when the step drops it (tests/unit_tests/tools/test_gc.py shows
    the report of one that is)."""
    tmp_path, out = fsdp_tp_run
    assert "--training.gc_debug: collecting every step" in out
    assert "in reference cycles" not in out and not (tmp_path / GC_DEBUG_FOLDER).exists()


def test_comm_trace_and_profiler_traces_fsdp_x_tp(fsdp_tp_run):
    tmp_path, out = fsdp_tp_run
    assert "Collectives of step 2" in out
    for rank in range(4):
        table = (tmp_path / "comm_trace" / f"rank{rank}_step2.txt").read_text()
        assert (tmp_path / "comm_trace" / f"rank{rank}_step2.json").exists()
        for step in (2, 4):
            trace = tmp_path / "profile_traces" / f"iteration_{step}" / f"rank{rank}_trace.json"
            assert json.loads(trace.read_text())["traceEvents"]
    # Per module: with sequence parallelism, attention and FFN each all-gather their
    # sequence-sharded input in forward (and again in backward); FSDP all-gathers each
    # block's parameters and reduce-scatters its gradients.
    lines = table.splitlines()

    def section(module: str) -> str:
        start = next(i for i, line in enumerate(lines) if line.strip() == module)
        indent = len(lines[start]) - len(lines[start].lstrip())
        end = next(
            (
                j
                for j in range(start + 1, len(lines))
                if lines[j].strip()
                and len(lines[j]) - len(lines[j].lstrip()) <= indent
                and "PASS" not in lines[j]
                and "*" not in lines[j]
            ),
            len(lines),
        )
        return "\n".join(lines[start:end])

    attention = section("FSDPTransformer.layers.0.attention")
    ffn = section("FSDPTransformer.layers.0.feed_forward")
    block = section("FSDPTransformer.layers.0")
    for module in (attention, ffn):
        assert "c10d_functional.all_gather_into_tensor" in module
        assert "FORWARD PASS" in module and "BACKWARD PASS" in module
    assert "c10d._allgather_base_" in block and "c10d._reduce_scatter_base_" in block


def test_fsdp_x_tp_adds_no_host_sync_to_the_step(fsdp_tp_run):
    """The sharded step reads on the host what the one-process step reads (the token count,
    the norm's finiteness): DTensor and FSDP wait for nothing."""
    tmp_path, out = fsdp_tp_run
    assert "Host syncs of step 3's training step" in out
    for rank in range(4):
        text = (tmp_path / "host_syncs" / f"rank{rank}_step3.txt").read_text()
        sites = [
            re.findall(r"(\d+)x .* in (\w+) <- .* in (\w+)", line) for line in text.splitlines()
        ]
        sites = sorted(found[0] for found in sites if found)
        assert sites == [
            ("1", "dist_reduce", "train_step"),
            ("1", "should_step", "train_step"),
        ], text


def _simulate(dump: Path, ngpu: int, *flags: str) -> subprocess.CompletedProcess:
    result = run_train(dump, *flags, ngpu=ngpu, COMM_MODE="local_tensor")
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_local_tensor_simulation_equals_the_real_four_rank_run(tmp_path, fsdp_tp_run):
    real, _ = fsdp_tp_run
    result = _simulate(tmp_path, 4, *FSDP_TP)
    assert "Simulating 4 ranks in one process" in result.stdout + result.stderr
    # FSDP2 cannot run under LocalTensorMode: the simulation shards with DTensor parameters.
    assert 'fsdp_impl = "simple"' in (tmp_path / "config.toml").read_text()
    simulated, reference = records(tmp_path), records(real)
    assert [r["step"] for r in simulated] == [r["step"] for r in reference] == [1, 2, 3, 4]
    # The same reductions in the same order: the losses are bitwise equal.
    assert [r["loss"] for r in simulated] == [r["loss"] for r in reference]
    assert [r["loss_max"] for r in simulated] == [r["loss_max"] for r in reference]
    # FSDP2 and DTensor-parametrized sharding average gradients in different orders.
    for sim, ref in zip(simulated, reference, strict=True):
        assert sim["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    # Rank 0 holds a quarter of the parameters, as in the real run.
    assert simulated[0]["param_mib"] == pytest.approx(reference[0]["param_mib"], rel=0.01)


def test_local_tensor_runs_the_sixteen_rank_example(tmp_path, fsdp_tp_run):
    """dp 2 x tp 8 reads the same data as dp 2 x tp 2: the same losses up to TP's sum order."""
    real, _ = fsdp_tp_run
    flags = ["--training.steps", "2", "--parallelism.tensor_parallel_degree", "8", *LR]
    _simulate(tmp_path, 16, *flags, "--parallelism.data_parallel_shard_degree", "2")
    simulated, reference = records(tmp_path), records(real)[:2]
    assert [r["step"] for r in simulated] == [1, 2]
    for sim, ref in zip(simulated, reference, strict=True):
        assert sim["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert sim["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_local_tensor_starts_from_a_seed_checkpoint(tmp_path, fsdp_tp_run):
    """A seed checkpoint of seed 0's weights, loaded by a simulation told --debug.seed 5: it
    trains as the real FSDP 2 x TP 2 run from seed 0 does, bitwise, and saves nothing."""
    real, _ = fsdp_tp_run
    seed = _run_train(tmp_path, "--checkpoint.create_seed_checkpoint", "--checkpoint.enable")
    assert seed.returncode == 0, seed.stderr[-3000:]
    flags = ["--training.steps", "2", "--parallelism.tensor_parallel_degree", "2", *LR]
    result = _simulate(tmp_path, 4, *flags, "--checkpoint.enable", "--debug.seed", "5")
    out = result.stdout + result.stderr
    assert "Loading model weights from" in out and "never written" in out
    simulated, reference = records(tmp_path), records(real)[:2]
    assert [r["loss"] for r in simulated] == [r["loss"] for r in reference]
    saved = (tmp_path / "checkpoint").glob("step-*")  # beside the lock of the seed's run
    assert sorted(p.name for p in saved) == ["step-0"]


def test_local_tensor_simulates_pipeline_x_fsdp_x_tp(tmp_path, fsdp_tp_run):
    """PP 2 x FSDP 2 x TP 2 on 8 simulated ranks (a thread per pipeline rank) reads the data of
    FSDP 2 x TP 2 and trains alike: micro-batching only changes the order of sums."""
    real, _ = fsdp_tp_run
    flags = ["--training.steps", "2", "--parallelism.tensor_parallel_degree", "2", *LR]
    result = _simulate(tmp_path, 8, *flags, "--parallelism.pipeline_parallel_degree", "2")
    out = result.stdout + result.stderr
    assert "pp=2" in out and "world_size=8" in out
    assert out.count("Training finished") == 1  # the other pipeline rank's thread is quiet
    simulated, reference = records(tmp_path), records(real)[:2]
    assert [r["step"] for r in simulated] == [1, 2]
    for sim, ref in zip(simulated, reference, strict=True):
        assert sim["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert sim["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert "pp_idle_pct" not in sim  # threads taking turns: no bubble to measure
    # Rank 0 holds half of the first stage's parameters (FSDP 2 x TP 2 shards them 4 ways).
    assert simulated[0]["param_mib"] < reference[0]["param_mib"]


def test_local_tensor_simulates_fsdp_x_cp_x_tp(tmp_path, fsdp_tp_run):
    """FSDP 2 x CP 2 x TP 2 on 8 simulated ranks reads the data of FSDP 2 x TP 2 (the same
    data-parallel ranks) and trains alike: splitting the sequences only changes the order of
    the attention's sums. The simulation's attention gathers K/V instead of passing them
    around a ring."""
    real, _ = fsdp_tp_run
    flags = ["--training.steps", "2", "--parallelism.tensor_parallel_degree", "2", *LR]
    flags += ["--parallelism.context_parallel_degree", "2"]
    result = _simulate(tmp_path, 8, *flags, "--parallelism.data_parallel_shard_degree", "2")
    assert "cp=2" in result.stdout + result.stderr
    simulated, reference = records(tmp_path), records(real)[:2]
    assert [r["step"] for r in simulated] == [1, 2]
    for sim, ref in zip(simulated, reference, strict=True):
        assert sim["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert sim["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_local_tensor_simulates_mixture_of_experts_under_tp_ep_and_pp(tmp_path):
    """DeepSeek-V3's debug model, FSDP 2 x TP 2 on 4 simulated ranks, reads the data of the
    real FSDP 2 run: the same losses up to TP's order of sums, the same expert loads (each
    simulated rank routes its own tokens; the grouped GEMM's sizes differ between ranks).
    So do, for two steps, EP 2 over the TP ranks (experts FSDP-sharded over efsdp 2; the
    all-to-all in padded slots) and PP 2 x FSDP 2 (a thread per stage; each stage's MoE
    metrics gathered across the threads)."""
    moe = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel"]
    moe += ["--training.steps", "3", "--moe.aux_loss_coeff", "0.01", *LR]
    real = _run_train(tmp_path / "real", *moe, "--training.local_batch_size", "4", ngpu=2)
    assert real.returncode == 0, real.stderr[-3000:]
    flags = [*moe, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]
    _simulate(tmp_path / "simulated", 4, *flags)
    simulated, reference = records(tmp_path / "simulated"), records(tmp_path / "real")
    assert [r["step"] for r in simulated] == [1, 2, 3]
    for sim, ref in zip(simulated, reference, strict=True):
        assert sim["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert sim["moe_load_max_over_mean"] == pytest.approx(ref["moe_load_max_over_mean"])
        assert sim["moe_aux_loss"] == pytest.approx(ref["moe_aux_loss"], rel=1e-4)
    ep = [*flags, "--parallelism.expert_parallel_degree", "2"]
    pp = [*moe, "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2"]
    pp += ["--parallelism.pipeline_parallel_microbatch_size", "2"]
    for name, layout in (("ep", ep), ("pp", pp)):
        _simulate(tmp_path / name, 4, *layout, "--training.steps", "2")
        simulated = records(tmp_path / name)
        assert [r["step"] for r in simulated] == [1, 2], name
        for sim, ref in zip(simulated, reference[:2], strict=True):
            assert sim["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
            assert sim["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), name
            assert sim["moe_load_max_over_mean"] == pytest.approx(ref["moe_load_max_over_mean"])


def test_local_tensor_simulates_a_v_shaped_schedule(tmp_path):
    """DualPipeV (two stages per rank, V placement, split backward) simulated on 2 ranks
    gives the losses of one process."""
    flags = ["--training.steps", "2", *LR]
    reference = tmp_path / "one"
    assert _run_train(reference, *flags).returncode == 0
    pp = ["--parallelism.pipeline_parallel_degree", "2"]
    _simulate(
        tmp_path / "sim", 2, *flags, *pp, "--parallelism.pipeline_parallel_schedule", "DualPipeV"
    )
    simulated, expected = records(tmp_path / "sim"), records(reference)
    assert [r["step"] for r in simulated] == [1, 2]
    for sim, ref in zip(simulated, expected, strict=True):
        assert sim["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert sim["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_memory_timeline_on_cpu(tmp_path):
    result = _run_train(
        tmp_path,
        *SNAPSHOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "need the CUDA caching allocator" in result.stdout + result.stderr
    times, sizes = json.loads(
        (tmp_path / "memory_snapshot" / "iteration_2" / "rank0_memory_timeline.json").read_text()
    )
    assert len(times) == len(sizes) > 10
    assert max(sum(s) for s in sizes) > 10 * 2**20  # the model alone is 22 MiB


def test_memory_snapshot_under_fsdp_on_cpu_falls_back_to_allocation_events(tmp_path):
    """torch 2.13 cannot categorize an FSDP step's memory on CPU (an assertion in its memory
    profiler): the run goes on, with the raw allocation events written instead."""
    result = _run_train(tmp_path, *SNAPSHOT, ngpu=2)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "memory_snapshot" / "iteration_2"
    timeline, trace = folder / "rank0_memory_timeline.json", folder / "rank0_memory_trace.json"
    assert timeline.is_file() or trace.is_file()
    if trace.is_file():  # the fallback (a torch that categorizes would write the timeline)
        output = result.stdout + result.stderr
        assert "could not categorize this step's memory" in output
        assert "MiB, reached in aten::" in output  # the peak, and where
        events = json.loads(trace.read_text())["traceEvents"]
        totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
        assert max(totals) > 10 * 2**20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="allocator snapshots need CUDA")
def test_cuda_memory_snapshot_and_oom_dump(tmp_path):
    result = _run_train(
        tmp_path,
        *SNAPSHOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "memory_snapshot/iteration_2/rank0_memory_snapshot.pickle").stat().st_size
    oom = _run_train(
        tmp_path / "oom",
        "--training.local_batch_size",
        "100000",
        "--profiling.enable_memory_snapshot",
    )
    assert oom.returncode != 0
    assert (tmp_path / "oom/memory_snapshot/iteration_1_exit/rank0_memory_snapshot.pickle").exists()


def test_non_finite_step_stops_or_is_skipped(tmp_path):
    flags = ["--training.steps", "4", "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0"]
    flags += ["--checkpoint.enable", "--checkpoint.interval", "1"]
    stopped = _run_train(tmp_path / "stop", *flags)
    assert stopped.returncode != 0, stopped.stderr[-3000:]  # the rank exits 3; torchrun says 1
    err = stopped.stdout + stopped.stderr
    assert "the gradient norm is nan" in err or "the gradient norm is inf" in err
    assert "rank 0" in err and "last good checkpoint:" in err and "step-1" in err
    skipped = _run_train(tmp_path / "skip", *flags, "--debug.skip_nonfinite_steps")
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    steps = records(tmp_path / "skip")
    assert steps[-1]["skipped_steps"] >= 1 and steps[0]["skipped_steps"] == 0


def test_same_seed_is_bitwise_reproducible_and_another_seed_is_not(tmp_path):
    flags = ["--training.steps", "3", "--debug.deterministic"]
    runs = {}
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        result = _run_train(tmp_path / name, *flags, "--debug.seed", seed, ngpu=2)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = [(r["loss"], r["grad_norm"]) for r in records(tmp_path / name)]
    assert runs["a"] == runs["b"]
    assert runs["a"][0] != runs["c"][0]

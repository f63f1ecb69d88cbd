"""Bad input, tried as a new user would: one line naming the flag (or file) and the fix, exit
code 2, no Python traceback; before any rank starts where the rule needs no torch, and
whichever rank refuses when a rank finds it. docs/troubleshooting.md lists the same cases.
Also an unexpected exception in one rank: named as the cause on every node."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO, SMALL, clean_env, run_train
from slurm_cluster import submit, wait

pytestmark = pytest.mark.integration


def _files(tmp: Path) -> dict[str, Path]:
    """Bad files of every kind, made once per test."""
    made = {
        "empty.jsonl": "",
        "notext.jsonl": '{"txt": "hello"}\n',
        "nonstring.jsonl": '{"text": 5}\n{"text": "a"}\n',
        "malformed.jsonl": '{"text": "fine"}\n{"text": "broken\n',
        "allempty.jsonl": '{"text": ""}\n' * 20,
        "tokenizer.json": '{"not": "a tokenizer"}\n',
        "tokenizer.model": "not base64 ranks\n",
        "a_file": "",
        "bad.jinja": "{% for m in messages %}\n",
    }
    for name, text in made.items():
        (tmp / name).write_text(text)
    return {name.replace(".", "_"): tmp / name for name in made}


# (flags, expected line, found before any rank starts)
PREFLIGHT = [
    (["--checkpoint.enable", "--checkpoint.interval", "0"], "--checkpoint.interval=0 must be >= 1"),
    (["--optimizer.lr", "inf"], "--optimizer.lr=inf must be > 0 and finite"),
    (["--training.max_norm", "nan"], "--training.max_norm=nan must be finite"),
    (
        ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"],
        "must be 'op' or a positive integer",
    ),
    (
        ["--checkpoint.enable", "--checkpoint.exclude_from_loading", "modle"],
        "not a checkpoint part (did you mean model?)",
    ),
    (["--job.dump_folder", ""], "--job.dump_folder is empty"),
    (["--job.dump_folder", "{a_file}"], "is a file, not a folder"),
    (["--checkpoint.enable", "--checkpoint.folder", "{a_file}/ckpt"], "is a file, not a folder"),
    (
        ["--checkpoint.enable", "--checkpoint.folder", "/proc/titan-ckpt"],
        "--checkpoint.folder: cannot write in /proc/titan-ckpt (",  # (the reason); choose
    ),
    (["--model.tokenizer_path", "{tmp}/missing"], "missing does not exist; download the model's tokenizer"),
    (
        ["--training.dataset", "c4", "--training.dataset_path", "{tmp}/c4"],
        "c4: nothing there; give a file, glob or folder",
    ),
    (
        ["--training.dataset", "files", "--training.dataset_path", "{tmp}/shards/*.jsonl"],
        "*.jsonl: nothing there; give a file, glob or folder",
    ),
    (
        ["--training.dataset", "tokens", "--training.dataset_path", "{tmp}/tokens"],
        "tokens does not exist, so no pre-tokenized data is there; write it with",
    ),
    (["--training.stepz", "3"], "unknown flag --training.stepz (did you mean --training.steps?)"),
    (["--parallelism.data_parallel_replicate_degree", "3"], "world size 2 is not divisible"),
    (
        ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"],
        "--training.seq_len=66 must split into 2 x cp = 4 chunks",
    ),
    (
        ["--training.data_format", "chat", "--training.chat_template", "{bad_jinja}"],
        "bad.jinja is not valid Jinja (line 1): Unexpected end of template",
    ),
    (
        ["--training.chat_template", "{bad_jinja}"],
        "--training.chat_template does nothing with --training.data_format text",
    ),
    (
        ["--optimizer.param_groups", "norm:wd=0"],
        "--optimizer.param_groups 'norm:wd=0': 'wd=0' is not key=value with a key of lr_scale",
    ),
    (
        ["--parallelism.fsdp_impl", "simpel"],
        "--parallelism.fsdp_impl=simpel is not a choice: use one of auto, fsdp2, simple (did you mean simple?)",
    ),
    (
        ["--checkpoint.enable", "--checkpoint.no_initial_load_model_only"],
        "--checkpoint.no_initial_load_model_only needs --checkpoint.initial_load_path: the step-N folder of the run to fork",
    ),
    (
        ["--debug.detect_anomaly", "--compile.enable"],
        "--debug.detect_anomaly checks each module's output eagerly, which a compiled block does not expose",
    ),
    (
        ["--debug.detect_anomaly", "--debug.skip_nonfinite_steps"],
        "--debug.skip_nonfinite_steps steps past it: choose one",
    ),
]  # fmt: skip

IN_RANK = [
    (["--model.tokenizer_path", "{tokenizer_model}"], "is not a tiktoken ranks file"),
    (["--model.tokenizer_path", "{tokenizer_json}"], "not a Hugging Face tokenizer.json"),
    (["--training.dataset", "files", "--training.dataset_path", "{empty_jsonl}"], "is empty"),
    (
        ["--training.dataset", "files", "--training.dataset_path", "{notext_jsonl}"],
        "its rows have the fields ['txt'], no 'text'",
    ),
    (
        ["--training.dataset", "files", "--training.dataset_path", "{nonstring_jsonl}"],
        "a int as 'text', not text",
    ),
    (
        ["--training.dataset", "files", "--training.dataset_path", "{malformed_jsonl}"],
        "malformed.jsonl, line 2 is not valid JSON",
    ),
    (
        ["--training.data_format", "chat", "--training.dataset", "files", "--training.dataset_path", "{notext_jsonl}"],
        "no 'messages'; --training.data_format chat reads rows with 'messages'",
    ),
    (["--training.dataset", "chat_demo"], "chat_demo holds chat rows"),
    (
        ["--optimizer.param_groups", "nrom:weight_decay=0"],
        "--optimizer.param_groups 'nrom:weight_decay=0': no trainable parameter takes it",
    ),
    (
        ["--training.dataset", "files", "--training.dataset_path", "{allempty_jsonl}"],
        "all 10 documents of data-parallel rank",  # either rank may stop first
    ),
]  # fmt: skip


def _run(tmp_path: Path, flags: list[str], **env: str) -> subprocess.CompletedProcess:
    paths = {k: str(v) for k, v in _files(tmp_path).items()} | {"tmp": str(tmp_path)}
    flags = [f.format(**paths) for f in flags]
    dump = tmp_path / "dump"
    return run_train(dump, *flags, ngpu=2, timeout=120, **env)


LOST_PEER = "another rank went away during a collective"
CLOCK_AHEAD = Path(__file__).parent / "clock_ahead"


def _assert_one_line(result: subprocess.CompletedProcess, expected: str) -> str:
    """The one error line of a refused run: a rank that loses the refusing one in a
    collective says nothing on the console (its log file has it)."""
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and expected in errors[0], out[-3000:]
    return errors[0]


@pytest.mark.parametrize(("flags", "expected"), PREFLIGHT)
def test_refused_before_any_rank_starts(tmp_path, flags, expected):
    result = _run(tmp_path, flags)
    line = _assert_one_line(result, expected)
    assert line.startswith("config error:")
    assert not (tmp_path / "dump").exists()  # nothing started, nothing written


@pytest.mark.parametrize(("flags", "expected"), IN_RANK)
def test_refused_by_a_rank_in_one_line(tmp_path, flags, expected):
    line = _assert_one_line(_run(tmp_path, flags), expected)
    assert line.startswith("[rank")


def _rank_1_fails(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """``refuse_harness.py`` on two ranks of one node, rank 1 failing, ``LOG_RANK=0``."""
    return subprocess.run(
        [sys.executable, "-m", "torchtitan.launcher", "--nproc_per_node", "2"]
        + ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
        + ["--local-ranks-filter", "0", "--role", "rank", "--tee", "3"]
        # torchrun stops rank 0 up to 3 s after rank 1 exits (0.1 s by default): time for
        # rank 0, still building its trainer (no SIGTERM handler yet), to reach its next
        # collective and write what it lost to its log.
        + ["--monitor-interval", "3"]
        + ["tests/integration_tests/refuse_harness.py", *SMALL]
        + ["--job.dump_folder", str(tmp_path)],
        cwd=REPO,
        env=clean_env(REFUSE_RANK="1", **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_only_rank_1_refuses_and_its_line_is_shown(tmp_path):
    """Rank 0 goes on and waits for rank 1 in a collective, which rank 1 leaves 2 s later by
    refusing; LOG_RANK=0 hides rank 1's console: the launcher still shows rank 1's line and
    exits with its code, and rank 0's loss of rank 1 (exit code 4) goes to its log file only,
    as does gloo's C++ line for it."""
    result = _rank_1_fails(tmp_path, REFUSE_AFTER_S="2")
    line = _assert_one_line(result, "only rank 1 refuses this input")
    assert line.startswith("[rank1] error:")
    logs = list(tmp_path.glob("logs/*/rank0.log"))
    assert len(logs) == 1 and LOST_PEER in logs[0].read_text()  # it did lose rank 1


def _two_nodes(
    tmp_path: Path, *, max_restarts: int = 1, clock_ahead_s: float = 0, **env: str
) -> list[subprocess.CompletedProcess]:
    """Two launchers of one rank each, as on two nodes under Slurm (a c10d rendezvous,
    ``max_restarts``, each launcher with its own failure folder), running ``refuse_harness.py``
    with ``env``; the first hosts the rendezvous's store (``REFUSE_ON_THIS_NODE=1``) and gets
    rank 0 (ranks follow the order the launchers started in). The second node's wall clock
    runs ``clock_ahead_s`` ahead (``clock_ahead/sitecustomize.py``, in its launcher and rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torchtitan.launcher", "--nnodes", "2"]
            + ["--max-restarts", str(max_restarts)]
            + ["--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_id", "test"]
            + ["--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_conf", f"is_host={host}"]
            + ["--role", "rank", "--tee", "3", "tests/integration_tests/refuse_harness.py"]
            + [*SMALL, "--job.dump_folder", str(tmp_path / f"node{i}")],
            cwd=REPO,
            env=clean_env(REFUSE_ON_THIS_NODE=str(int(host)), **env, **_clock(host, clock_ahead_s)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, host in enumerate((True, False))
    ]
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
        return [
            subprocess.CompletedProcess(node.args, node.returncode, *output)
            for node, output in zip(nodes, outputs, strict=True)
        ]
    finally:
        for node in nodes:
            node.kill()


def _clock(host: bool, ahead_s: float) -> dict[str, str]:
    """The environment that sets a node's wall clock ``ahead_s`` ahead (none for the host)."""
    if host or not ahead_s:
        return {}
    path = os.pathsep.join(filter(None, [str(CLOCK_AHEAD), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "TITAN_TEST_CLOCK_AHEAD_S": str(ahead_s)}


def test_a_refusal_on_another_node_is_each_nodes_one_line(tmp_path):
    """The rank of the node hosting the rendezvous's store refuses 2 s late while the other
    waits for it in a collective. The other node's rank, which only lost its peer, looks into
    that store 1 s later, as under load, and finds the refusal (still there: the refusing
    node's launcher waits before it ends); its launcher prints the same line with the same exit
    code and does not restart: not its rank's lost peer, torchrun's report of exit code 4, a
    restart, or a traceback."""
    results = _two_nodes(tmp_path, REFUSE_AFTER_S="2", READ_REFUSAL_AFTER_S="1")
    lines = [_assert_one_line(result, "refuses this input") for result in results]
    for result in results:
        assert LOST_PEER not in result.stdout + result.stderr
        assert "[launcher]" not in result.stdout + result.stderr
    # The host's rank is rank 0, whose own store goes with it when restarts are on (the
    # rendezvous's stays).
    assert lines == ["[rank0] error: only rank 0 refuses this input"] * 2
    logs = list(tmp_path.glob("node1/logs/*/rank1.log"))
    assert len(logs) == 1 and LOST_PEER in logs[0].read_text()  # it did lose rank 0


def test_an_exception_on_another_node_is_named_by_every_node(tmp_path):
    """As above, but rank 0 raises an exception, in both attempts (one restart). Its node
    shows its traceback and names it; the other node, whose rank only lost it (and read the
    store 1 s late), names it too, with its host and log file, at the restart and at the end,
    rather than its own rank's lost peer. The second node's lines carry its global rank. Its
    clock runs 30 s ahead: no node takes another's records for an earlier attempt's by their
    time."""
    results = _two_nodes(
        tmp_path,
        clock_ahead_s=30,
        REFUSE_BY_CRASHING="1",
        REFUSE_AFTER_S="2",
        READ_REFUSAL_AFTER_S="1",
    )
    outs = [result.stdout + result.stderr for result in results]
    assert [result.returncode for result in results] == [1, 1], outs[1][-3000:]
    error = "ValueError: rank 0 crashed while building its data"
    assert outs[0].count(f"[rank0]: {error}") == 2, outs[0][-3000:]  # each attempt's traceback
    [log] = tmp_path.glob("node0/logs/*/rank0.log")
    named = f"rank 0 raised {error} (traceback in {log})"
    there = f"rank 0, on {socket.gethostname()}, raised {error} (traceback in {log} there)"
    restart = "[launcher] restart 1 of 1: "
    assert f"{restart}{named}; restarting" in outs[0], outs[0][-3000:]
    assert outs[0].splitlines()[-1] == f"[launcher] the job failed: {named}"
    # The other node restarts when its rank loses rank 0, or, when rank 0's node came back to
    # meet again first, without counting it (a restart left: see launcher.main, and then rank
    # 0's end of the job is read in the store before it would restart again).
    counted = f"{restart}{there} (then rank 1 lost contact and stopped); restarting"
    uncounted = f"[launcher] restarting every rank: another node restarted its ranks: {there}; "
    assert counted in outs[1] or uncounted in outs[1], outs[1][-3000:]
    final = f"[launcher] the job failed: {there} (then rank 1 lost contact and stopped)"
    assert outs[1].splitlines()[-1].startswith(final), outs[1][-3000:]
    assert LOST_PEER not in outs[1] and "Root Cause" not in outs[0] + outs[1]
    ranks = {line.split("]:")[0] for line in outs[1].splitlines() if line.startswith("[rank")}
    assert ranks == {"[rank1"}, ranks  # not torchrun's local rank, 0 on every node


def test_a_kill_on_another_node_is_named_by_every_node(tmp_path):
    """As above, but rank 0 is killed (SIGKILL: no record of its own, as the kernel's
    out-of-memory killer leaves), in both attempts. The other node's rank only lost it; its
    launcher names the kill, with its host, from what rank 0's agent published in the
    rendezvous's store, at the restart and at the end, rather than its own rank's exit code."""
    results = _two_nodes(tmp_path, REFUSE_BY_DYING="1", REFUSE_AFTER_S="2")
    outs = [result.stdout + result.stderr for result in results]
    assert [result.returncode for result in results] == [1, 1], outs[1][-3000:]
    killed = "rank 0 was killed by SIGKILL"
    restart = "[launcher] restart 1 of 1: "
    assert f"{restart}{killed}; restarting" in outs[0], outs[0][-3000:]
    assert outs[0].splitlines()[-1] == f"[launcher] the job failed: {killed}", outs[0][-3000:]
    there = f"on {socket.gethostname()}, {killed}"
    counted = f"{restart}{there} (then rank 1 lost contact and stopped); restarting"
    uncounted = f"[launcher] restarting every rank: another node restarted its ranks: {there}; "
    assert counted in outs[1] or uncounted in outs[1], outs[1][-3000:]  # as above
    final = f"[launcher] the job failed: {there} (then rank 1 lost contact and stopped)"
    assert outs[1].splitlines()[-1] == final, outs[1][-3000:]
    assert "Root Cause" not in outs[1] and "frame #" not in outs[0] + outs[1]


def test_a_node_whose_ranks_never_notice_is_stopped_with_the_cause(tmp_path):
    """As above, but the other node's rank never notices that rank 0 is gone: it waits without
    end and only notes SIGTERM, as a rank waits in an NCCL collective. At the restart its
    launcher kills it at once, not after a SIGTERM and torchrun's wait (30 s); at the end it
    reads the failing node's end of the job in the rendezvous's store, kills its rank and
    names the same exception (else torchrun would wait for the rank, 600 s after SIGTERM)."""
    # Rank 0 raises 2 s late, when rank 1 waits (else rank 1 may still be joining a process
    # group, and notice rank 0's exit through the store, as in CI once).
    results = _two_nodes(
        tmp_path, REFUSE_BY_CRASHING="1", HANG_UNLESS_REFUSING="1", REFUSE_AFTER_S="2"
    )
    outs = [result.stdout + result.stderr for result in results]
    assert [result.returncode for result in results] == [1, 1], outs[1][-3000:]
    error = "ValueError: rank 0 crashed while building its data"
    [log] = tmp_path.glob("node0/logs/*/rank0.log")
    assert outs[0].splitlines()[-1] == f"[launcher] the job failed: rank 0 raised {error} " + (
        f"(traceback in {log})"
    )
    there = f"rank 0, on {socket.gethostname()}, raised {error} (traceback in {log} there)"
    restart = f"[launcher] restarting every rank: another node restarted its ranks: {there}; "
    assert restart in outs[1], outs[1][-3000:]
    final = f"[launcher] the job failed: {there}; rank 1, still running on this node, was stopped"
    assert outs[1].splitlines()[-1] == final, outs[1][-3000:]
    assert "SIGTERM noted" not in outs[1] and "frame #" not in outs[0] + outs[1]


def test_an_exception_on_a_hidden_rank_is_named_with_its_traceback(tmp_path):
    """One node, ``LOG_RANK=0``: rank 1 raises 2 s late while rank 0 waits for it in a
    collective. The launcher shows rank 1's traceback (its console is hidden) and names its
    exception first, though rank 0 may end before it; not torchrun's report of exit codes, nor
    rank 0's lost peer (in its log file only)."""
    result = _rank_1_fails(tmp_path, REFUSE_BY_CRASHING="1", REFUSE_AFTER_S="2")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    lines = out.splitlines()
    error = "ValueError: rank 1 crashed while building its data"
    assert f"[rank1]: {error}" in lines and "[rank1]: Traceback (most recent call last):" in lines
    [log] = tmp_path.glob("logs/*/rank1.log")
    assert lines[-1].startswith(f"[launcher] the job failed: rank 1 raised {error} (traceback in ")
    assert f"(traceback in {log})" in lines[-1] and "Root Cause" not in out
    assert LOST_PEER not in out
    logs = list(tmp_path.glob("logs/*/rank0.log"))
    assert len(logs) == 1 and LOST_PEER in logs[0].read_text()  # it did lose rank 1


@pytest.mark.usefixtures("slurm_cluster")
def test_a_refusal_on_one_slurm_node_is_each_nodes_one_line(tmp_path):
    """``multinode_trainer.slurm`` on the local two-node cluster, one rank per node, restarts
    on: a data file whose second half is empty documents leaves data-parallel rank 1's share
    all empty, so rank 1 alone refuses, while rank 0, on the other node, waits for it. Each
    node's launcher prints rank 1's line and exits 2, and the job fails with 2: before the
    job's store carried the refusal, the first node printed its rank's lost peer, restarted
    it, and ended in a traceback of the lost rendezvous."""
    data = tmp_path / "half_empty.jsonl"
    rows = [{"text": f"document {i}. " * 20} for i in range(10)] + [{"text": ""}] * 10
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = submit(
        REPO / "multinode_trainer.slurm", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
        f"--output={tmp_path}/slurm-%j.out",
        script_args=(
            *SMALL, "--job.dump_folder", str(tmp_path / "dump"), "--training.dataset", "files",
            "--training.dataset_path", str(data),
        ),
        env=clean_env(CONFIG="llama3_debugmodel", NPROC_PER_NODE="1", MAX_RESTARTS="1"),
        cwd=REPO,
    )  # fmt: skip
    end = wait(job, 240)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert (end["state"], end["exit_code"]) == ("FAILED", 2), out[-3000:]
    refusal = "[rank1] error: dataset files=" + str(data) + ": all 10 documents of data-parallel"
    lines = out.splitlines()
    assert sum(line.startswith(refusal) for line in lines) == 2, out[-3000:]
    assert "Traceback" not in out and "[launcher]" not in out and LOST_PEER not in out, out[-3000:]


def test_non_finite_step_exits_3_in_one_line(tmp_path):
    result = run_train(tmp_path, "--optimizer.lr", "1e30", "--training.steps", "5", ngpu=2)
    out = result.stdout + result.stderr
    assert result.returncode == 3, out[-3000:]
    assert "Traceback" not in out
    line = out.splitlines()[-1]
    assert "the gradient norm is" in line
    assert "--debug.detect_anomaly finds the module where it starts" in line
    step = line.split("step ", 1)[1].split(":", 1)[0]
    assert f"(resume skipping it: --training.skip_steps {step})" in line


def test_detect_anomaly_names_where_the_step_went_non_finite(tmp_path):
    """With tensor parallel (DTensor gradients, which autograd's own NaN check cannot read)
    the gradient checks at the modules name the block whose output first received NaN and
    the weights that blew up (a learning rate of 1e30 makes the final norm's backward NaN)."""
    flags = ["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0", "--training.steps"]
    flags += ["4", "--debug.detect_anomaly", "--parallelism.tensor_parallel_degree", "2"]
    result = run_train(tmp_path, *flags, ngpu=2)
    out = result.stdout + result.stderr
    assert result.returncode == 3, out[-3000:]
    assert "Traceback" not in out
    line = out.splitlines()[-1]
    assert "step 2, rank " in line, line
    assert "the gradient reaching the output of layers.5 (TransformerBlock) holds nan" in line
    assert "(the last gradient found finite reached norm (RMSNorm))" in line, line
    largest = r"in this rank's model, the largest parameter value is 1\.\d+e\+30 \(in [\w.]+, "
    assert re.search(largest + "this rank's shard\\)", line), line


def test_log_rank_outside_the_world_is_refused(tmp_path):
    result = run_train(tmp_path, ngpu=2, log_rank="5")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "config error: LOG_RANK=5: 5 is not a rank of NGPU=2 (0..1, comma-separated)"
    )

"""The hang report on written dumps: who waited for whom (the real two-rank hang, through the
launcher, is in tests/integration_tests/test_debugging.py)."""

import json
from pathlib import Path

import pytest

from torchtitan.tools import hang_report

STACK = """Current thread 0x01 (most recent call first):
  File "/x/torchtitan/tools/watchdog.py", line 83 in _fire
  File "/usr/lib/python3.11/threading.py", line 982 in run

Thread 0x02 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1250 in _get_data
  File "/x/torchtitan/components/dataloader.py", line 301 in __next__
  File "/x/torchtitan/trainer.py", line 388 in train
  File "/x/torchtitan/train.py", line 61 in <module>
"""


def _entry(group: str, seq: int, op: str = "gloo:all_reduce", *, done: bool = True, size=(1,)):
    return {
        "collective_seq_id": seq,
        "process_group": [group, {"0": "default_pg", "3": "mesh_tp"}.get(group, "mesh")],
        "profiling_name": op,
        "input_sizes": [list(size)],
        "input_dtypes": ["Float"],
        "is_p2p": False,
        "pg_id": int(group) + 100,  # (a local id: pg_status is keyed by it)
        "retired": done,
        "state": "scheduled",
    }


def _dump(
    folder: Path, rank: int, entries, groups, *, run="r1", attempt=0, stack=None, status=None
):
    folder.mkdir(parents=True, exist_ok=True)
    titan = {"run": run, "attempt": attempt, "rank": rank, "step": 3, "time": 1.0 + attempt}
    titan["groups"] = groups
    raw = {"entries": entries, "pg_config": {}, "pg_status": status or {}, "titan": titan}
    (folder / f"rank{rank}_flight_recorder.json").write_text(json.dumps(raw))
    if stack is not None:
        (folder / f"rank{rank}_stacks.txt").write_text(stack)


def _history(group: str, upto: int):
    return [_entry(group, s) for s in range(1, upto + 1)]


def test_the_rank_behind_is_named_first_with_where_it_was(tmp_path):
    """Rank 3 stopped in its data; rank 1 waits for it in the dp group, rank 0 for rank 1 in
    the TP group (4 ranks: TP pairs 0-1 and 2-3, dp pairs 0-2 and 1-3)."""
    groups = {"0": [0, 1, 2, 3], "3": [0, 1], "4": [2, 3], "5": [0, 2], "6": [1, 3]}
    tp = {0: "3", 1: "3", 2: "4", 3: "4"}
    dp = {0: "5", 1: "6", 2: "5", 3: "6"}
    for rank in range(4):
        entries = _history(tp[rank], 9) + _history(dp[rank], 4)
        if rank in (0, 2):
            entries.append(_entry(tp[rank], 10, done=False))  # waits for its TP partner
        if rank == 1:
            entries += _history(tp[rank], 10)[9:]  # finished TP 10
            entries.append(_entry(dp[rank], 5, done=False))  # waits for rank 3 in dp
        _dump(tmp_path, rank, entries, groups, stack=STACK if rank == 3 else None)
    lines = hang_report.diagnose(hang_report.load(tmp_path), world_size=4)
    # The innermost frame, in a library, and the innermost of our code.
    assert lines[0] == (
        "rank 3 was outside any communication, at torch/utils/data/dataloader.py:1250 in "
        "_get_data, from /x/torchtitan/components/dataloader.py:301 in __next__ "
        f"({tmp_path / 'rank3_stacks.txt'})"
    )
    assert (
        "rank 1 waited in gloo:all_reduce (collective 5 of group 6 (mesh)), which rank 3 never "
        "reached" in lines
    )
    assert any(line.startswith("rank 2 waited") and "which rank 3 never" in line for line in lines)
    # Rank 0's TP partner finished collective 10 of group 3, so rank 0 waits on nobody there.
    assert not any("rank 1 never reached" in line for line in lines)


def test_ranks_in_different_collectives_at_the_same_point_disagree(tmp_path):
    groups = {"0": [0, 1]}
    _dump(tmp_path, 0, _history("0", 6) + [_entry("0", 7, done=False)], groups)
    gather = _entry("0", 7, "gloo:all_gather", done=False)
    _dump(tmp_path, 1, _history("0", 6) + [gather], groups)
    (line,) = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert line.startswith("the ranks disagree on collective 7 of group 0 (default_pg): rank 0 ")
    assert "gloo:all_reduce" in line and "rank 1 gloo:all_gather" in line
    # Uneven all-to-all splits (MoE dispatch) are not a disagreement.
    _dump(tmp_path, 0, [_entry("0", 1, "gloo:all_to_all", done=False, size=(5, 8))], groups)
    _dump(tmp_path, 1, [_entry("0", 1, "gloo:all_to_all", done=False, size=(3, 8))], groups)
    (line,) = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert line.startswith("every rank of group 0 (default_pg) waited in gloo:all_to_all")


def test_no_rank_in_a_collective_means_the_step_itself_was_slow(tmp_path):
    for rank in (0, 1):
        _dump(tmp_path, rank, _history("0", 4), {"0": [0, 1]}, stack=STACK)
    (line,) = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert line.startswith("no rank was inside a collective")
    assert "--comm.train_timeout_seconds" in line and "rank 1 at torch/utils/data/" in line


def test_a_member_without_a_dump_is_named(tmp_path):
    _dump(tmp_path, 0, _history("0", 4) + [_entry("0", 5, done=False)], {"0": [0, 1]})
    lines = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert lines == [
        "rank 0 waited in gloo:all_reduce (collective 5 of group 0 (default_pg)) with rank 1, "
        "which left no dump here",
        "rank 1 left no dump (stopped before their watchdog fired, or wrote it to another "
        "machine's dump folder)",
    ]
    # No dumped rank in a collective, one rank without a dump: no advice to raise the timeout.
    _dump(tmp_path, 0, _history("0", 4), {"0": [0, 1]}, stack=STACK)
    lines = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert lines[0].startswith("no rank that left a dump was inside a collective")
    assert not any("raise it" in line for line in lines)


def test_only_the_newest_run_and_attempt_are_read(tmp_path):
    """A dump folder keeps files of an earlier run's ranks that a smaller run did not
    overwrite, and of an earlier attempt of this run."""
    _dump(tmp_path, 0, [_entry("0", 5, done=False)], {"0": [0, 1]}, attempt=1)
    _dump(tmp_path, 1, _history("0", 4), {"0": [0, 1]}, attempt=1, stack=STACK)
    _dump(tmp_path, 2, [_entry("0", 9, done=False)], {"0": [0, 1, 2]}, run="old")
    dumps = hang_report.load(tmp_path)
    assert sorted(dumps) == [0, 1]
    assert sorted(hang_report.load(tmp_path, run="old", attempt=0)) == [2]
    assert hang_report.load(tmp_path, run="r1", attempt=0) == {}
    lines = hang_report.diagnose(dumps, world_size=2)
    assert lines[0].startswith("rank 1 was outside any communication")


def test_the_command_line_reads_a_dump_folder(tmp_path, capsys):
    traces = tmp_path / "comm_traces"
    _dump(traces, 0, _history("0", 4) + [_entry("0", 5, done=False)], {"0": [0, 1]})
    _dump(traces, 1, _history("0", 4), {"0": [0, 1]}, stack=STACK)
    assert hang_report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "- rank 1 was outside any communication" in out
    assert hang_report.main([str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize("text", ["", "Thread 0x1 (most recent call first):\n  <no Python frame>"])
def test_a_stack_dump_without_a_main_thread(tmp_path, text):
    path = tmp_path / "s.txt"
    path.write_text(text)
    assert hang_report.where(path) == "no main thread in its stack dump"
    assert hang_report.where(None) == "no stack dump"


# A rank started with `python -m torchtitan.train`: its main thread's outermost frame is
# runpy's, and the watchdog names the main thread on the first line.
MODULE_RUN = """# main thread 0x00007f00000000b0
Current thread 0x00007f00000000a0 (most recent call first):
  File "/x/torchtitan/tools/watchdog.py", line 83 in _fire

Thread 0x00007f00000000b0 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/distributed/pipelining/schedules.py", line 683 in _wait_batch_p2p
  File "/x/torchtitan/batch_runner.py", line 209 in _pipeline_step
  File "/x/torchtitan/train.py", line 61 in main
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""


def test_a_pipeline_wait_shows_in_the_stack_when_the_recorder_lists_none(tmp_path):
    """gloo records no sends and receives: rank 0 waits in a receive from rank 1's stage,
    which sleeps; the recorder shows both outside any collective."""
    _dump(tmp_path, 0, _history("0", 8), {"0": [0, 1]}, stack=MODULE_RUN)
    _dump(tmp_path, 1, _history("0", 8), {"0": [0, 1]}, stack=STACK.replace("_get_data", "sleep"))
    lines = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert lines[0].startswith("rank 1 was outside any communication, at torch/utils/data/")
    assert lines[1] == (
        "rank 0 waited in communication the flight recorder does not list (a pipeline send "
        "or receive), at torch/distributed/pipelining/schedules.py:683 in _wait_batch_p2p, from "
        "/x/torchtitan/batch_runner.py:209 in _pipeline_step"
    )
    assert len(lines) == 2  # no advice to raise the timeout


def test_rooted_collectives_may_differ_in_shapes(tmp_path):
    """A scatter's source passes the tensors, the others none: not a disagreement."""
    groups = {"0": [0, 1]}
    _dump(tmp_path, 0, [_entry("0", 3, "gloo:scatter", done=False, size=(2, 8))], groups)
    _dump(tmp_path, 1, [_entry("0", 3, "gloo:scatter", done=False, size=())], groups)
    (line,) = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert line.startswith("every rank of group 0 (default_pg) waited in gloo:scatter")
    # The same all-reduce with different shapes is one.
    _dump(tmp_path, 0, [_entry("0", 3, done=False, size=(2, 8))], groups)
    _dump(tmp_path, 1, [_entry("0", 3, done=False, size=(4, 8))], groups)
    (line,) = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert line.startswith("the ranks disagree on collective 3")


def test_the_recorders_own_count_tells_who_is_behind_when_its_ring_dropped_entries(tmp_path):
    """Rank 1's ring kept no entry of group 0 past 2, but it issued 7: it is not behind
    rank 0's collective 7, which it finished; rank 0's dump was taken before it saw so."""
    groups = {"0": [0, 1]}
    _dump(tmp_path, 0, _history("0", 6) + [_entry("0", 7, done=False)], groups)
    status = {"100": {"last_enqueued_collective": "7", "last_completed_collective": "7"}}
    _dump(tmp_path, 1, _history("0", 2), groups, status=status, stack=STACK)
    (line,) = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert line == (
        "rank 0 waited in gloo:all_reduce (collective 7 of group 0 (default_pg)), which the "
        "other members had finished (dumps taken apart)"
    )


def test_gloo_and_nccl_number_a_groups_collectives_apart(tmp_path):
    """On CUDA a group is gloo + NCCL, each counting its own collectives: rank 1's NCCL
    collective 40 says nothing of whether it reached gloo's 11."""
    groups = {"0": [0, 1]}
    nccl = [_entry("0", s, "nccl:all_reduce") for s in range(1, 41)]
    _dump(tmp_path, 0, _history("0", 10) + nccl + [_entry("0", 11, done=False)], groups)
    _dump(tmp_path, 1, _history("0", 10) + nccl, groups, stack=STACK)
    lines = hang_report.diagnose(hang_report.load(tmp_path), world_size=2)
    assert lines[1] == (
        "rank 0 waited in gloo:all_reduce (collective 11 of group 0 (default_pg)), which rank 1 "
        "never reached"
    )
    assert lines[0].startswith("rank 1 was outside any communication")

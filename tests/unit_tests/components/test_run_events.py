"""events.jsonl, and a new run in a dump folder that holds an earlier run's records."""

import json
import os
import time

import pytest

from torchtitan.components.run_events import RunEvents


@pytest.mark.parametrize(
    ("resumed", "env", "new"),
    [
        (False, {}, True),  # from step 0, or forked from another run's step
        (True, {}, False),  # resumed from a checkpoint of its own folder
        (False, {"TORCHELASTIC_RESTART_COUNT": "1"}, False),  # restarted before its first save
        (False, {"SLURM_RESTART_COUNT": "2"}, False),  # requeued before its first save
    ],
)
def test_without_a_run_id_the_launchers_counts_say_whether_a_run_continues(
    tmp_path, monkeypatch, resumed, env, new
):
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "TITAN_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert RunEvents(tmp_path, enabled=True).is_new_run(resumed) is new


def test_with_a_run_id_a_run_continues_only_once_it_started(tmp_path, monkeypatch):
    """An attempt that died before its first step wrote no start: the next attempt (restart
    count 1) is still the run's first start and sets an older run's records aside."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_RUN_ID", "20261127-180000")
    events = RunEvents(tmp_path, enabled=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # an older run's
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "start", "run": "old"}) + "\n")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert events.is_new_run(False)
    events.set_aside_if_new(resumed=False)
    events.start(0, world_size=2)
    assert (tmp_path / "earlier_runs").is_dir() and not (tmp_path / "metrics.jsonl").exists()
    # A later attempt of this run continues it, from step 0 too (no checkpoint yet).
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert not events.is_new_run(False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeue has a new id: counts decide
    monkeypatch.setenv("TITAN_RUN_ID", "20261127-190000")
    assert not events.is_new_run(False)


def test_an_earlier_run_is_set_aside_whole_and_never_overwritten(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    events = RunEvents(tmp_path, enabled=True, config_file="config.toml")
    began = time.mktime((2026, 11, 27, 9, 30, 5, 0, 0, -1))
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"event": "start", "time": began, "step": 0}) + "\n"
    )
    for name in ("metrics.jsonl", "metrics_rank1.jsonl", "report.txt", "report.png"):
        (tmp_path / name).write_text(name)
    (tmp_path / "config.toml").write_text("its config")
    (tmp_path / "trace.json").write_text("kept")  # not a record of the run
    moved = events.set_aside_earlier_run()
    assert moved == tmp_path / "earlier_runs" / "20261127-093005"
    assert sorted(p.name for p in moved.iterdir()) == [
        "config.toml", "events.jsonl", "metrics.jsonl", "metrics_rank1.jsonl", "report.png",
        "report.txt",
    ]  # fmt: skip
    assert (moved / "metrics_rank1.jsonl").read_text() == "metrics_rank1.jsonl"
    assert (moved / "config.toml").read_text() == "its config"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier_runs", "trace.json"]
    # Nothing to set aside: nothing moves. A config alone was written by an attempt of the
    # new run that died before its first step (no records): it stays, to be rewritten.
    (tmp_path / "config.toml").write_text("the new run's")
    assert events.set_aside_earlier_run() is None
    assert (tmp_path / "config.toml").read_text() == "the new run's"
    # A second run begun in the same second (no events file: the metrics file's time) goes
    # beside the first, not over it.
    (tmp_path / "metrics.jsonl").write_text("second")
    os.utime(tmp_path / "metrics.jsonl", (began, began))
    again = events.set_aside_earlier_run()
    assert again == tmp_path / "earlier_runs" / "20261127-093005~2"
    assert (again / "metrics.jsonl").read_text() == "second"
    assert (moved / "metrics.jsonl").read_text() == "metrics.jsonl"


def test_ranks_that_write_no_events_move_nothing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("x")
    assert RunEvents(tmp_path, enabled=False).set_aside_earlier_run() is None
    assert (tmp_path / "metrics.jsonl").exists()


def test_a_config_outside_the_dump_folder_is_not_moved(tmp_path):
    """``--job.save_config_file`` may name a path elsewhere: not the run's to move."""
    dump, elsewhere = tmp_path / "dump", tmp_path / "elsewhere"
    dump.mkdir()
    elsewhere.mkdir()
    for config_file in (str(elsewhere / "shared.toml"), "../elsewhere/shared.toml"):
        (dump / "metrics.jsonl").write_text("x")
        (elsewhere / "shared.toml").write_text("shared")
        moved = RunEvents(dump, enabled=True, config_file=config_file).set_aside_earlier_run()
        assert sorted(p.name for p in moved.iterdir()) == ["metrics.jsonl"]
        assert (elsewhere / "shared.toml").read_text() == "shared"


def test_the_earlier_runs_config_goes_by_the_name_its_start_recorded(tmp_path, monkeypatch):
    """The earlier run saved ``config.toml``, the new one saves ``resolved.toml``."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "TITAN_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    RunEvents(tmp_path, enabled=True, config_file="config.toml").start(0, world_size=1)
    (tmp_path / "config.toml").write_text("earlier")
    moved = RunEvents(tmp_path, enabled=True, config_file="resolved.toml").set_aside_earlier_run()
    assert sorted(p.name for p in moved.iterdir()) == ["config.toml", "events.jsonl"]


def test_configs_that_share_a_name_or_name_a_record_move_once_each(tmp_path, monkeypatch):
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "TITAN_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "a").mkdir()
    RunEvents(tmp_path, enabled=True, config_file="a/config.toml").start(0, world_size=1)
    (tmp_path / "a" / "config.toml").write_text("earlier")
    (tmp_path / "config.toml").write_text("older still")
    (tmp_path / "report.txt").write_text("report")
    for config_file in ("config.toml", "report.txt", "a/../config.toml"):
        events = RunEvents(tmp_path, enabled=True, config_file=config_file)
        moved = events.set_aside_earlier_run()
        if moved is not None:
            break
    assert (moved / "a" / "config.toml").read_text() == "earlier"
    assert (moved / "config.toml").read_text() == "older still"
    assert (moved / "report.txt").read_text() == "report"

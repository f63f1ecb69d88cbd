"""The step watchdog in one process: what it writes when a step outlives its timeout."""

import json
import threading
import time

from torchtitan.tools import hang_report, watchdog


def test_a_late_step_is_dumped_with_this_run_and_its_main_thread(tmp_path, monkeypatch):
    exits: list[int] = []
    fired = threading.Event()

    def fake_exit(code: int) -> None:
        exits.append(code)
        fired.set()
        threading.Event().wait()  # the watchdog thread (a daemon) stops here

    monkeypatch.setattr(watchdog, "DUMP_GRACE_SECONDS", 0.0)
    monkeypatch.setattr(watchdog.os, "_exit", fake_exit)
    monkeypatch.setenv("TITAN_RUN_ID", "run-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    dog = watchdog.StepWatchdog(str(tmp_path), rank=3)
    dog.start(1, 0.2)
    dog.stop()  # a step that finished in time
    time.sleep(0.5)
    assert not fired.is_set()
    dog.start(2, 0.2)
    assert fired.wait(30)
    assert exits == [watchdog.EXIT_CODE] == [124]
    traces = tmp_path / "comm_traces"
    titan = json.loads((traces / "rank3_flight_recorder.json").read_text())["titan"]
    assert (titan["run"], titan["attempt"], titan["rank"], titan["step"]) == ("run-7", 1, 3, 2)
    assert "groups" in titan
    # The main thread (this test's) is found by the name the dump gives it.
    frames = hang_report.main_frames(traces / "rank3_stacks.txt")
    assert frames and frames[0][2] == "wait"  # in fired.wait(...), below
    assert "test_a_late_step_is_dumped_with_this_run_and_its_main_thread" in [f[2] for f in frames]

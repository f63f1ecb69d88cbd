"""The run report (torchtitan/tools/report.py) on synthetic dump folders: the figure's panels and
curves, the summary's facts, the CLI, and the text-only path without matplotlib."""

import builtins
import json
import logging
import subprocess
import sys

import pytest

from torchtitan.tools import report
from torchtitan.tools.logging import logger


def _record(step: int, loss: float, **extra: float) -> dict:
    return {
        "step": step,
        "loss": loss,
        "loss_max": loss + 0.1,
        "grad_norm": 1.0 / step,
        "lr": 1e-3,
        "tps": 1000.0 + step,
        "tflops": 0.1,
        "step_time_s": 0.5,
        "data_loading_pct": 1.0,
        "memory_peak_gib": 0.5 + step / 100,
        "loss_local": loss,
        "skipped_steps": 0,
    } | extra


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def gpu_run(tmp_path):
    """Logged every 10 steps with MFU and validation at 20 and 40; crashed after step 30,
    torchrun restarted it from the step-20 checkpoint (step 30 is redone), then it was
    preempted at 40 and requeued from the step-40 checkpoint, crashed at once and was restarted
    by torchrun, finishing at 50."""
    mfu = {"mfu_pct": 30.0, "memory_peak_reserved_gib": 2.0}
    records = [
        _record(1, 9.0, **mfu),
        _record(10, 8.0, **mfu),
        _record(20, 7.0, validation_loss=7.5, validation_perplexity=1808.04, **mfu),
        _record(30, 6.9, **mfu),  # lost with the crash, redone below
        _record(30, 6.0, **mfu),
        _record(40, 5.0, validation_loss=5.5, **mfu),
        _record(50, 4.0, **mfu),
    ]
    _write(tmp_path / "metrics.jsonl", records)
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 51, "lo\n')  # cut off by a kill
    start = {"event": "start", "requeue": 0, "world_size": 8}
    events = [
        start | {"time": 1000.0, "step": 0, "restart": 0},
        {"event": "checkpoint", "time": 1100.0, "step": 20, "seconds": 2.0},
        start | {"time": 1200.0, "step": 20, "restart": 1},
        {"event": "checkpoint", "time": 1300.0, "step": 40, "seconds": 4.0},
        {"event": "preempt", "time": 1301.0, "step": 40, "signal": "SIGUSR1"},
        {"event": "end", "time": 1302.0, "step": 40, "status": "preempted"},
        start | {"time": 5000.0, "step": 40, "restart": 0, "requeue": 1},
        # A crash in the requeued job before it logged: torchrun's restart 1 in SLURM's requeue 1.
        start | {"time": 5010.0, "step": 40, "restart": 1, "requeue": 1},
        {"event": "end", "time": 5100.0, "step": 50, "status": "finished"},
    ]
    _write(tmp_path / "events.jsonl", events)
    return tmp_path


@pytest.fixture
def cpu_run(tmp_path):
    """Every step logged, no MFU, no validation, no events.jsonl (an older dump)."""
    _write(tmp_path / "metrics.jsonl", [_record(s, 10.0 - s) for s in (1, 2, 3)])
    return tmp_path


def _lines(ax) -> dict:
    return {line.get_label(): line for line in ax.lines if not line.get_label().startswith("_")}


def test_figure_panels_and_curves_are_the_last_record_of_each_step(gpu_run):
    fig = report.figure(report.load_run(gpu_run))
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == ["loss", "grad norm", "tokens/s per device", "MFU", "peak memory"]
    assert all(ax.get_xlabel() == "step" for ax in fig.axes)
    steps = [1, 10, 20, 30, 40, 50]
    loss = _lines(axes["loss"])["loss"]
    assert list(loss.get_xdata()) == steps
    assert list(loss.get_ydata()) == [9.0, 8.0, 7.0, 6.0, 5.0, 4.0]  # step 30: the redone 6.0
    validation = _lines(axes["loss"])["validation loss"]
    assert list(validation.get_xdata()) == [20, 40]
    assert list(validation.get_ydata()) == [7.5, 5.5]
    assert list(_lines(axes["grad norm"])["grad norm"].get_ydata()) == [1 / s for s in steps]
    assert list(_lines(axes["tokens/s per device"])["tokens/s"].get_ydata()) == [
        1000.0 + s for s in steps
    ]
    assert list(_lines(axes["MFU"])["MFU"].get_ydata()) == [30.0] * 6
    memory = _lines(axes["peak memory"])
    assert list(memory["active"].get_ydata()) == [0.5 + s / 100 for s in steps]
    assert list(memory["reserved"].get_ydata()) == [2.0] * 6
    # The restarts (from 20 after the crash, from 40 twice) and both checkpoints, on every panel.
    for ax in fig.axes:
        marks = [(line.get_gid(), line.get_xdata()[0]) for line in ax.lines if line.get_gid()]
        assert sorted(marks) == [("checkpoint", 20), ("checkpoint", 40)] + [
            ("restart", 20),
            ("restart", 40),
            ("restart", 40),
        ]


def test_figure_leaves_out_mfu_and_validation_when_not_recorded(cpu_run):
    fig = report.figure(report.load_run(cpu_run))
    assert [ax.get_title() for ax in fig.axes] == [
        "loss",
        "grad norm",
        "tokens/s per device",
        "peak memory",
    ]
    assert list(_lines(fig.axes[0])) == ["loss"]
    assert list(_lines(fig.axes[0])["loss"].get_ydata()) == [9.0, 8.0, 7.0]
    assert not any(line.get_gid() for ax in fig.axes for line in ax.lines)


def test_summary_of_a_restarted_run(gpu_run):
    run = report.load_run(gpu_run)
    assert run.redone_steps == [30] and run.bad_lines == 1
    # Names in a 13-character column, values after it.
    lines = {line[:13].rstrip(): line[13:] for line in report.summary(run).splitlines()}
    assert lines["steps"] == "1 .. 50 (6 logged, 1 redone after a restart)"
    # 4100 s from the first start to the last event; 0.5 s a step over 50 steps.
    assert lines["time"] == "1h 08m 20s wall (first start to last event), 25.0 s in training steps"
    assert lines["final loss"] == "4.0000 (step 50)"
    assert lines["val loss"] == "5.5000 (step 40)"
    assert lines["tokens/s"] == "1,030 mean per device"  # steps 10..50: step 1 is warm-up
    assert lines["MFU"] == "30.0% mean"
    assert lines["peak memory"] == "1.00 GiB (active, 2.00 GiB reserved)"
    assert lines["restarts"] == "3 (2 after a crash, 1 requeued or resumed)"
    assert lines["checkpoints"] == "2 written at steps 20, 40 (3.0 s mean save)"
    assert lines["preempted"] == "at step 40 (SIGUSR1)"
    assert lines["status"] == "finished at step 50"
    assert lines["skipped"].startswith("1 unreadable line")


def test_summary_without_events(cpu_run):
    text = report.summary(report.load_run(cpu_run))
    assert "steps        1 .. 3 (3 logged)\n" in text
    assert "time         1.5 s in training steps\n" in text
    assert "final loss   7.0000 (step 3)\n" in text
    assert "tokens/s     1,002 mean per device\n" in text
    assert "peak memory  0.53 GiB (process RSS)\n" in text
    assert "restarts     none seen; no events.jsonl to say more\n" in text
    assert text.endswith("checkpoints  unknown (no events.jsonl)")
    assert "MFU" not in text and "val loss" not in text


def test_cli_writes_png_and_summary(gpu_run, capsys):
    assert report.main([str(gpu_run)]) == 0
    out = capsys.readouterr().out
    assert (gpu_run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (gpu_run / "report.txt").read_text() in out
    assert f"report: {gpu_run / 'report.png'}" in out


def test_cli_without_metrics_exits_2(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no metrics.jsonl in {tmp_path}" in err


def test_without_matplotlib_writes_the_text_only(cpu_run, monkeypatch, caplog):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(logger, "propagate", False)  # as after init_logger(): count lines once
    logger.addHandler(caplog.handler)
    try:
        path, text = report.write_report(cpu_run)
    finally:
        logger.removeHandler(caplog.handler)
    assert path is None and not (cpu_run / "report.png").exists()
    assert (cpu_run / "report.txt").read_text() == text + "\n"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [report.NO_MATPLOTLIB]


def test_report_does_not_import_torch():
    code = "import sys, torchtitan.tools.report; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_skipped_data_is_listed_shaded_and_not_timed(tmp_path):
    """Records at 1, 10 and 20 with steps 11-19 skipped (read and dropped, untimed): step 20's
    record times one trained step, so 0.5 + 9 x 0.5 + 0.5 s train."""
    _write(tmp_path / "metrics.jsonl", [_record(s, 10.0 - s / 10) for s in (1, 10, 20)])
    events = [
        {"event": "start", "time": 0.0, "step": 0, "restart": 0, "requeue": 0, "world_size": 1},
        {"event": "skip", "time": 1.0, "step": 11, "last": 19},
        {"event": "skip", "time": 2.0, "step": 25, "last": 25},
        *({"event": "spike", "time": 2.5, "step": s, "why": "..."} for s in (21, 22, 24, 22)),
        {"event": "end", "time": 3.0, "step": 25, "status": "finished"},
    ]
    _write(tmp_path / "events.jsonl", events)
    run = report.load_run(tmp_path)
    text = report.summary(run)
    assert "5.5 s in training steps" in text
    assert "skips        the data of steps 11-19, 25 (--training.skip_steps)\n" in text
    assert "spikes       3 update(s) skipped, steps 21, 22, 24 (events.jsonl)\n" in text
    shaded = [p for p in report.figure(run).axes[0].patches if p.get_gid() == "skipped data"]
    assert len(shaded) == 2

"""A run's report from its dump folder: curves in ``report.png`` and a one-screen summary in
``report.txt``, read from ``metrics.jsonl`` (one record per logged step, appended across
restarts) and ``events.jsonl`` (starts, checkpoints, preemptions, end; absent in older dumps).

    python -m torchtitan.tools.report DUMP_FOLDER

Torch-free, so a report works on any machine that has the folder. matplotlib draws the PNG;
without it the text summary is still written.
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# With --metrics.save_for_all_ranks rank 0 writes metrics_rank0.jsonl instead.
METRICS_FILES = ("metrics.jsonl", "metrics_rank0.jsonl")
NO_MATPLOTLIB = (
    "report: matplotlib is not installed (pip install matplotlib); wrote the text summary only"
)
# Figure panels: title, y label, (record key, line label) ...; a panel whose first key no
# record carries is left out (MFU on CPU).
PANELS = [
    ("loss", "loss", [("loss", "loss"), ("validation_loss", "validation loss")]),
    ("grad norm", "grad norm", [("grad_norm", "grad norm")]),
    ("tokens/s per device", "tokens/s", [("tps", "tokens/s")]),
    ("MFU", "MFU (%)", [("mfu_pct", "MFU")]),
    (
        "peak memory",
        "GiB",
        [("memory_peak_gib", "active"), ("memory_peak_reserved_gib", "reserved")],
    ),
]


@dataclass
class Run:
    """One dump folder's run. ``records``: the last metrics record of each logged step, in step
    order (a step redone after a restart shows its redone values); ``redone_steps``: the logged
    steps that had more than one record; ``rewinds``: how often the step went back in the
    metrics file; ``events``: None without ``events.jsonl``; ``bad_lines``: lines that were not
    JSON (a write cut off by a crash)."""

    folder: Path
    records: list[dict[str, Any]]
    redone_steps: list[int] = field(default_factory=list)
    rewinds: int = 0
    events: list[dict[str, Any]] | None = None
    bad_lines: int = 0

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of ``key`` over the records that carry it."""
        rows = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        return [s for s, _ in rows], [v for _, v in rows]

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events or [] if e.get("event") == kind]

    @property
    def restarts(self) -> list[dict[str, Any]]:
        """Start events after the first: the run came back from a checkpoint."""
        return self.events_of("start")[1:]

    @property
    def crash_restarts(self) -> int:
        """Restarts by torchrun after a failure (``TORCHELASTIC_RESTART_COUNT`` > 0)."""
        return sum(1 for e in self.restarts if e.get("restart", 0) > 0)

    @property
    def requeues(self) -> int:
        """Restarts as a new job: a SLURM requeue or a resumption by hand."""
        return len(self.restarts) - self.crash_restarts


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON lines of ``path`` and how many lines were not JSON (a write cut off)."""
    rows, bad = [], 0
    for line in filter(str.strip, path.read_text().splitlines()):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    return rows, bad


def metrics_path(dump_folder: str | Path) -> Path | None:
    """The rank-0 metrics file of ``dump_folder``, or None when it has none."""
    paths = [Path(dump_folder) / name for name in METRICS_FILES]
    return next((p for p in paths if p.is_file()), None)


def load_run(dump_folder: str | Path) -> Run:
    """Read ``dump_folder``'s metrics and events; FileNotFoundError without a metrics file."""
    folder = Path(dump_folder)
    path = metrics_path(folder)
    if path is None:
        raise FileNotFoundError(f"no {METRICS_FILES[0]} in {folder}")
    raw, bad = read_jsonl(path)
    by_step: dict[int, dict[str, Any]] = {}
    redone: set[int] = set()
    rewinds = sum(1 for a, b in zip(raw, raw[1:], strict=False) if b["step"] <= a["step"])
    for record in raw:
        if record["step"] in by_step:
            redone.add(record["step"])
        by_step[record["step"]] = record
    run = Run(folder, [by_step[s] for s in sorted(by_step)], sorted(redone), rewinds)
    if (folder / "events.jsonl").is_file():
        run.events, more = read_jsonl(folder / "events.jsonl")
        bad += more
    run.bad_lines = bad
    return run


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{seconds:.1f} s"
    h, m = divmod(s // 60, 60)
    return f"{h}h {m:02d}m {s % 60:02d}s" if h else f"{m}m {s % 60:02d}s"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _training_seconds(records: list[dict[str, Any]], skipped: set[int]) -> float:
    """Each record's ``step_time_s`` is the mean over the steps trained since the record
    before it (``skipped``: steps whose data was skipped, untrained and not timed)."""
    total, previous = 0.0, 0
    for r in records:
        trained = sum(1 for s in range(previous + 1, r["step"] + 1) if s not in skipped)
        total += r.get("step_time_s", 0.0) * max(trained, 1)
        previous = r["step"]
    return total


def _metric_rows(run: Run) -> list[tuple[str, str]]:
    recs = run.records
    redone = f", {len(run.redone_steps)} redone after a restart" if run.redone_steps else ""
    rows = [("steps", f"{recs[0]['step']} .. {recs[-1]['step']} ({len(recs)} logged{redone})")]
    skipped = {s for e in run.events_of("skip") for s in range(e["step"], e["last"] + 1)}
    time = f"{_duration(_training_seconds(recs, skipped))} in training steps"
    starts = run.events_of("start")
    if starts and run.events[-1] is not starts[0]:
        wall = run.events[-1]["time"] - starts[0]["time"]
        time = f"{_duration(wall)} wall (first start to last event), {time}"
    rows += [("time", time), ("final loss", f"{recs[-1]['loss']:.4f} (step {recs[-1]['step']})")]
    steps, losses = run.series("validation_loss")
    if steps:
        ppl = next(r.get("validation_perplexity") for r in recs if r["step"] == steps[-1])
        ppl = f", perplexity {ppl:,.2f}" if ppl is not None else ""
        rows.append(("val loss", f"{losses[-1]:.4f} (step {steps[-1]}{ppl})"))
    # Step 1's record carries the warm-up (compilation, first allocations): leave it out.
    warm = [r for r in recs if r["step"] > 1] or recs
    rows.append(("tokens/s", f"{_mean([r['tps'] for r in warm]):,.0f} mean per device"))
    mfu = [r["mfu_pct"] for r in warm if r.get("mfu_pct") is not None]
    if mfu:
        rows.append(("MFU", f"{_mean(mfu):.1f}% mean"))
    _, memory = run.series("memory_peak_gib")
    _, reserved = run.series("memory_peak_reserved_gib")
    if memory:  # no reserved figure: a CPU run, whose peak is the process's resident set
        kind = f"active, {max(reserved):.2f} GiB reserved" if reserved else "process RSS"
        rows.append(("peak memory", f"{max(memory):.2f} GiB ({kind})"))
    return rows


def _event_rows(run: Run) -> list[tuple[str, str]]:
    if run.events is None:
        seen = f"at least {run.rewinds} (the step went back)" if run.rewinds else "none seen"
        return [
            ("restarts", f"{seen}; no events.jsonl to say more"),
            ("checkpoints", "unknown (no events.jsonl)"),
        ]
    n, why = len(run.restarts), f"{run.crash_restarts} after a crash, {run.requeues} requeued"
    rows = [("restarts", f"{n} ({why} or resumed)" if n else "0")]
    ckpts = run.events_of("checkpoint")
    text = f"{len(ckpts)} written"
    if ckpts:
        steps = [str(c["step"]) for c in ckpts]
        steps = steps if len(steps) <= 8 else steps[:3] + ["..."] + steps[-3:]
        seconds = _mean([c.get("seconds", 0.0) for c in ckpts])
        text += f" at steps {', '.join(steps)} ({seconds:.1f} s mean save)"
    rows.append(("checkpoints", text))
    for e in run.events_of("preempt"):
        rows.append(("preempted", f"at step {e['step']} ({e.get('signal')})"))
    skips = [f"{e['step']}-{e['last']}" if e["last"] > e["step"] else str(e["step"])
             for e in run.events_of("skip")]  # fmt: skip
    if skips:
        rows.append(("skips", f"the data of steps {', '.join(skips)} (--training.skip_steps)"))
    # (A run resumed from before a spike judges its step again: one entry per step.)
    spikes = [str(step) for step in sorted({e["step"] for e in run.events_of("spike")})]
    if spikes:
        shown = spikes if len(spikes) <= 8 else spikes[:3] + ["..."] + spikes[-3:]
        rows.append(
            ("spikes", f"{len(spikes)} update(s) skipped, steps {', '.join(shown)} (events.jsonl)")
        )
    end = run.events[-1] if run.events and run.events[-1].get("event") == "end" else None
    rows.append(("status", f"{end['status']} at step {end['step']}" if end else "no end event"))
    return rows


def summary(run: Run) -> str:
    """The run on one screen: one aligned ``name  value`` line per fact, with units."""
    rows = [("run", str(run.folder))]
    rows += _metric_rows(run) + _event_rows(run) if run.records else [("steps", "none logged")]
    if run.bad_lines:
        rows.append(("skipped", f"{run.bad_lines} unreadable line(s) (cut off by a crash?)"))
    return "\n".join(f"{name:<13}{value}" for name, value in rows)


def figure(run: Run) -> "Figure":
    """A grid of curves against the step (see ``PANELS``), restarts and checkpoints drawn as
    vertical lines (``gid`` "restart" / "checkpoint"), steps whose data was skipped shaded
    (``gid`` "skipped data"); drawn with Agg, no display needed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [p for p in PANELS if run.series(p[2][0][0])[0]]
    rows = max(1, math.ceil(len(panels) / 2))
    fig = Figure(figsize=(12, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, 2, squeeze=False).flat)
    marks = [(e["step"], "restart", "tab:red", "--") for e in run.restarts]
    marks += [(e["step"], "checkpoint", "tab:gray", ":") for e in run.events_of("checkpoint")]
    for ax, (title, ylabel, keys) in zip(axes, panels, strict=False):
        series = [(label, *run.series(key)) for key, label in keys]
        for label, steps, values in filter(lambda s: s[1], series):
            sparse = label == "validation loss"  # a few steps only: show the points
            ax.plot(steps, values, "o-" if sparse else "-", label=label, ms=4)
        for e in run.events_of("skip"):  # batches read and dropped, untrained
            ax.axvspan(e["step"] - 0.5, e["last"] + 0.5, color="tab:orange", alpha=0.15,
                       gid="skipped data")  # fmt: skip
        for i, (step, kind, color, style) in enumerate(marks):
            first = all(m[1] != kind for m in marks[:i])  # one legend entry per kind
            ax.axvline(step, color=color, ls=style, lw=0.8, label=kind if first else "_", gid=kind)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax is axes[0] or len(ax.lines) > len(marks) + 1:
            ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        fig.delaxes(ax)
    if run.records:
        fig.suptitle(
            f"{run.folder.name}: steps {run.records[0]['step']}..{run.records[-1]['step']}"
        )
    return fig


def write_report(dump_folder: str | Path) -> tuple[Path | None, str]:
    """Write ``report.txt`` and ``report.png`` into ``dump_folder``; return the PNG's path
    (None without matplotlib) and the summary."""
    run = load_run(dump_folder)
    text = summary(run)
    (run.folder / "report.txt").write_text(text + "\n")
    try:
        import matplotlib  # noqa: F401  (only to learn whether it is installed)
    except ImportError:
        logger.warning(NO_MATPLOTLIB)
        return None, text
    path = run.folder / "report.png"
    figure(run).savefig(path, dpi=100)
    return path, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump_folder", type=Path, help="a run's --job.dump_folder")
    args = parser.parse_args(argv)
    if metrics_path(args.dump_folder) is None:
        print(
            f"report: no metrics.jsonl in {args.dump_folder} (is it a run's --job.dump_folder?)",
            file=sys.stderr,
        )
        return 2
    path, text = write_report(args.dump_folder)
    print(text)
    print(f"report: {path or 'no PNG'}; summary in {args.dump_folder / 'report.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

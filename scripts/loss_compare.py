"""Check that a parallel config trains like a baseline: compare per-step loss (and other metrics)
of two training runs, printed as a table, plotted, and optionally asserted.

Run two configs from the same seed checkpoint, in deterministic mode, on the same data per step:

    python scripts/loss_compare.py \\
        --baseline "NGPU=1 --training.global_batch_size 4" --test "NGPU=2" \\
        --common "--training.steps 10 --training.local_batch_size 2 --training.seq_len 64" \\
        --assert-equal

Or compare two finished runs (a ``metrics.jsonl`` file or the dump folder holding it):

    python scripts/loss_compare.py --baseline-metrics outputs/a --test-metrics outputs/b --rtol 1e-5

Each of ``--baseline``, ``--test`` and ``--common`` is a shell-like string: leading
``NAME=value`` words are environment variables for ``./run_train.sh`` (``NGPU``, ``MODULE``,
``CONFIG``, ...), the rest are trainer flags. Later flags win, so side flags override common
ones, and both override the defaults this script adds. A value that is a single flag without a
space needs the ``=`` form: ``--test=--debug.deterministic_warn_only``.

Exit status: 0 every check passed; 1 a check failed or the step lists differ; 2 bad input;
3 a training run failed. See docs/converging.md.
"""

import argparse
import json
import math
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_TRAIN = REPO_ROOT / "run_train.sh"
PLOT_NAME = "loss_compare.png"
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_TAIL_LINES = 40


class UsageError(Exception):
    """Bad input: exit status 2."""


class RunFailed(Exception):
    """A training run exited non-zero or wrote no metrics: exit status 3."""


@dataclass
class RunSpec:
    """One side of the comparison: environment for ``run_train.sh`` and trainer flags."""

    env: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str, *, what: str) -> "RunSpec":
        try:
            words = shlex.split(text)
        except ValueError as e:
            raise UsageError(f"{what} {text!r}: {e}") from None
        env = {}
        while words and _ENV_WORD.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        return cls(env, words)


@dataclass
class Row:
    step: int
    baseline: float
    test: float

    @property
    def abs_diff(self) -> float:
        return abs(self.test - self.baseline)

    @property
    def rel_diff(self) -> float:
        """``|test - baseline| / |baseline|``; NaN when either value is NaN."""
        diff = self.abs_diff
        if diff == 0 or math.isnan(diff):
            return diff
        return diff / abs(self.baseline) if self.baseline != 0 else math.inf

    @property
    def bitwise_equal(self) -> bool:
        return struct.pack("<d", self.baseline) == struct.pack("<d", self.test)

    def within(self, *, rtol: float, atol: float) -> bool:
        """``|test - baseline| <= atol + rtol * |baseline|`` (numpy.isclose); NaN never is."""
        return self.bitwise_equal or self.abs_diff <= atol + rtol * abs(self.baseline)


@dataclass
class Comparison:
    """Both runs' values of the steps they share, per metric, and the steps only one has."""

    rows: dict[str, list[Row]]
    baseline_only: list[int]
    test_only: list[int]


# ---- reading metrics ---------------------------------------------------------------------


def load_metrics(path: Path) -> dict[int, dict]:
    """Records of ``path`` (a metrics.jsonl or a dump folder holding one), keyed by step.

    A step logged twice (a run resumed from an earlier checkpoint re-logs the steps after it)
    keeps its last record, the one training continued from.
    """
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"{file} does not exist (expected a metrics.jsonl or a dump folder)")
    records: dict[int, dict] = {}
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            records[int(record["step"])] = record
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{file}:{number}: not a metrics record ({e})") from None
    if not records:
        raise UsageError(f"{file} has no records")
    return records


def compare(baseline: dict[int, dict], test: dict[int, dict], metrics: list[str]) -> Comparison:
    steps = sorted(baseline.keys() & test.keys())
    rows = {}
    for metric in metrics:
        for name, records in (("baseline", baseline), ("test", test)):
            missing = [s for s in steps if metric not in records[s]]
            if missing:
                have = sorted(k for k in records[missing[0]] if k != "step")
                raise UsageError(
                    f"--metrics {metric}: the {name} run has no {metric!r} at step {missing[0]} "
                    f"(it has {', '.join(have)})"
                )
        rows[metric] = [Row(s, float(baseline[s][metric]), float(test[s][metric])) for s in steps]
    return Comparison(
        rows,
        baseline_only=sorted(baseline.keys() - test.keys()),
        test_only=sorted(test.keys() - baseline.keys()),
    )


# ---- reporting -----------------------------------------------------------------------------


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.3e}"


def format_table(metric: str, rows: list[Row]) -> str:
    baseline, test = f"baseline {metric}", f"test {metric}"
    header = f"{'step':>6}  {baseline:>20}  {test:>20}  {'abs diff':>10}  {'rel diff':>10}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.step:>6}  {r.baseline:>20.12g}  {r.test:>20.12g}  "
            f"{_num(r.abs_diff):>10}  {_num(r.rel_diff):>10}"
        )
    return "\n".join(lines)


def _worst(rows: list[Row], key: str) -> str:
    """The largest ``key`` of ``rows`` (NaN counts as largest) and where it is."""
    row = max(rows, key=lambda r: math.inf if math.isnan(v := getattr(r, key)) else v)
    value = getattr(row, key)
    return _num(value) if value == 0 else f"{_num(value)} (step {row.step})"


def format_summary(comparison: Comparison) -> str:
    lines = []
    for metric, rows in comparison.rows.items():
        equal = sum(r.bitwise_equal for r in rows)
        lines.append(
            f"  {metric:<10} bitwise equal at {equal}/{len(rows)} steps; "
            f"max abs diff {_worst(rows, 'abs_diff')}; max rel diff {_worst(rows, 'rel_diff')}"
        )
    return "\n".join(lines)


def _steps_text(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def run_checks(
    comparison: Comparison, *, assert_equal: bool, rtol: float | None, atol: float | None
) -> list[tuple[bool, str]]:
    """(passed, description) for the step lists and each requested check.

    ``--assert-equal`` is about the loss only: other metrics (the grad norm) are reduced in an
    order that depends on the sharding, so they are compared with ``--rtol`` / ``--atol``,
    which apply to every compared metric.
    """
    results = []
    if comparison.baseline_only or comparison.test_only:
        results.append(
            (
                False,
                "the runs logged different steps: baseline only "
                f"[{_steps_text(comparison.baseline_only)}], "
                f"test only [{_steps_text(comparison.test_only)}]",
            )
        )
    if assert_equal:
        if "loss" not in comparison.rows:
            raise UsageError("--assert-equal checks the loss: add loss to --metrics")
        bad = [r.step for r in comparison.rows["loss"] if not r.bitwise_equal]
        what = "--assert-equal: loss bitwise equal at every step"
        results.append(
            (not bad, what if not bad else f"{what}; differs at steps {_steps_text(bad)}")
        )
    if rtol is not None or atol is not None:
        given = {"--rtol": rtol, "--atol": atol}
        flags = " ".join(f"{flag} {value:g}" for flag, value in given.items() if value is not None)
        for metric, rows in comparison.rows.items():
            bad = [r.step for r in rows if not r.within(rtol=rtol or 0.0, atol=atol or 0.0)]
            what = f"{flags}: {metric} within tolerance at every step"
            results.append(
                (not bad, what if not bad else f"{what}; exceeded at steps {_steps_text(bad)}")
            )
    return results


def plot(comparison: Comparison, path: Path, *, labels: tuple[str, str]) -> bool:
    """Write both curves and their difference per metric to ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("matplotlib is not installed: no plot (get it with: pip install -e '.[plot]')")
        return False
    metrics = list(comparison.rows)
    fig, axes = plt.subplots(len(metrics), 2, figsize=(12, 3.5 * len(metrics)), squeeze=False)
    for (curves, diffs), metric in zip(axes, metrics, strict=True):
        rows = comparison.rows[metric]
        steps = [r.step for r in rows]
        curves.plot(steps, [r.baseline for r in rows], label=f"baseline: {labels[0]}")
        curves.plot(steps, [r.test for r in rows], "--", label=f"test: {labels[1]}")
        curves.set(xlabel="step", ylabel=metric, title=metric)
        curves.legend(fontsize="small")
        diffs.plot(steps, [r.test - r.baseline for r in rows], color="tab:red")
        diffs.axhline(0, color="gray", linewidth=0.5)
        diffs.set(xlabel="step", ylabel="test - baseline", title=f"{metric} difference")
        for ax in (curves, diffs):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ---- running -------------------------------------------------------------------------------


def _launch(name: str, env: dict[str, str], flags: list[str], folder: Path) -> None:
    """``./run_train.sh flags`` with ``env``, console output into ``folder/train.log``."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    log = folder / "train.log"
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    print(f"{name}: {shown} ./run_train.sh {shlex.join(flags)}", flush=True)
    print(f"  log: {log}", flush=True)
    # Launched from inside torchrun, these would point the child ranks at the wrong group.
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(
            [str(RUN_TRAIN), *flags],
            cwd=REPO_ROOT,
            env=base | env,
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-_TAIL_LINES:]
        raise RunFailed(
            f"{name} run failed (exit {code}); last lines of {log}:\n" + "\n".join(tail)
        )
    print(f"  done in {time.perf_counter() - start:.1f} s", flush=True)


def run_both(args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    """Seed checkpoint (unless disabled), then the baseline and test runs; their dump folders."""
    common = RunSpec.parse(args.common, what="--common")
    sides = {
        "baseline": RunSpec.parse(args.baseline, what="--baseline"),
        "test": RunSpec.parse(args.test, what="--test"),
    }
    defaults = [
        "--debug.seed",
        str(args.seed),
        "--training.data_sharding",
        args.data_sharding,
        "--metrics.no_enable_color_printing",  # the console goes to train.log
    ]
    if not args.no_deterministic:
        defaults.append("--debug.deterministic")
    if not args.no_seed_checkpoint:
        seed_folder = out / "seed"
        # One process, the baseline's model (MODULE/CONFIG) and the common flags: model-shaping
        # flags belong in --common, parallelism flags (which one process refuses) on the sides.
        seed_env = common.env | {
            k: v for k, v in sides["baseline"].env.items() if k in ("MODULE", "CONFIG")
        }
        _launch(
            "seed checkpoint",
            seed_env | {"NGPU": "1"},
            [
                *defaults,
                *common.flags,
                "--checkpoint.create_seed_checkpoint",
                "--checkpoint.folder",
                "checkpoint",
                "--job.dump_folder",
                str(seed_folder),
            ],
            seed_folder,
        )
        seed = seed_folder / "checkpoint" / "step-0"
        if not (seed / "manifest.json").is_file():
            raise RunFailed(
                f"the seed checkpoint run wrote no {seed}; see {seed_folder / 'train.log'}"
            )
        # initial_load_path is read only with checkpointing enabled; load_only: never save.
        defaults += [
            "--checkpoint.enable",
            "--checkpoint.load_only",
            "--checkpoint.initial_load_path",
            str(seed),
        ]
    folders = []
    for name, side in sides.items():
        folder = out / name
        forced = ["--job.dump_folder", str(folder), "--metrics.log_freq", "1"]
        _launch(
            name, common.env | side.env, [*defaults, *common.flags, *side.flags, *forced], folder
        )
        if not (folder / "metrics.jsonl").is_file():
            raise RunFailed(f"the {name} run wrote no {folder / 'metrics.jsonl'}")
        folders.append(folder)
    return folders[0], folders[1]


# ---- command line --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Compare per-step loss of a test config with a baseline (see docs/converging.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: 0 all checks passed, 1 a check failed or the step lists differ, "
        "2 bad input, 3 a training run failed",
    )
    run = p.add_argument_group("run two configs")
    run.add_argument(
        "--baseline", metavar="SPEC", help='e.g. "NGPU=1 --training.global_batch_size 4"'
    )
    run.add_argument(
        "--test", metavar="SPEC", help='e.g. "NGPU=2 --parallelism.tensor_parallel_degree 2"'
    )
    run.add_argument(
        "--common", metavar="SPEC", default="", help="environment and flags for both runs"
    )
    run.add_argument(
        "--seed", metavar="N", type=int, default=0, help="--debug.seed for every run (default 0)"
    )
    run.add_argument(
        "--no-seed-checkpoint",
        action="store_true",
        help="skip the seed checkpoint (initial weights then come from --seed alone)",
    )
    run.add_argument(
        "--no-deterministic", action="store_true", help="do not pass --debug.deterministic"
    )
    run.add_argument(
        "--data-sharding",
        choices=["by_row", "by_document"],
        default="by_row",
        help="--training.data_sharding for both runs; by_row (default) gives each step the same "
        "data whatever the data-parallel degree",
    )
    existing = p.add_argument_group("compare finished runs")
    existing.add_argument(
        "--baseline-metrics", metavar="PATH", type=Path, help="metrics.jsonl or dump folder"
    )
    existing.add_argument(
        "--test-metrics", metavar="PATH", type=Path, help="metrics.jsonl or dump folder"
    )
    check = p.add_argument_group("comparison")
    check.add_argument(
        "--metrics",
        default="loss",
        metavar="NAMES",
        help="comma-separated metrics to compare, e.g. loss,grad_norm (default loss)",
    )
    check.add_argument(
        "--assert-equal",
        action="store_true",
        help="fail unless the loss is bitwise equal at every step",
    )
    check.add_argument(
        "--rtol",
        type=float,
        help="fail if |test - baseline| > atol + rtol x |baseline| for a compared metric",
    )
    check.add_argument("--atol", type=float, help="absolute tolerance, with or without --rtol")
    check.add_argument(
        "--output-folder",
        type=Path,
        metavar="DIR",
        default=Path("outputs/loss_compare"),
        help=f"runs' dump folders (seed/, baseline/, test/: emptied first) and {PLOT_NAME}",
    )
    check.add_argument("--no-plot", action="store_true", help=f"do not write {PLOT_NAME}")
    return p


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """True to run both configs, False to compare finished runs; exits 2 on a bad mix."""
    running = args.baseline is not None or args.test is not None
    reading = args.baseline_metrics is not None or args.test_metrics is not None
    if running == reading:
        p.error("give either --baseline and --test, or --baseline-metrics and --test-metrics")
    if running and (args.baseline is None or args.test is None):
        p.error("--baseline and --test go together (an empty string runs the defaults)")
    if reading and (args.baseline_metrics is None or args.test_metrics is None):
        p.error("--baseline-metrics and --test-metrics go together")
    if reading and args.common:
        p.error("--common applies only when running --baseline and --test")
    for name in ("rtol", "atol"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            p.error(f"--{name}={value} must be >= 0")
    return running


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    running = _validate(p, args)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    if not metrics:
        p.error("--metrics names no metric")
    out = args.output_folder.resolve()
    try:
        if running:
            if not args.no_seed_checkpoint and args.no_deterministic:
                print("note: --no-deterministic: expect differences even with equal weights")
            baseline_path, test_path = run_both(args, out)
            labels = (args.baseline or "defaults", args.test or "defaults")
        else:
            baseline_path, test_path = args.baseline_metrics, args.test_metrics
            labels = (str(baseline_path), str(test_path))
        comparison = compare(load_metrics(baseline_path), load_metrics(test_path), metrics)
        if not next(iter(comparison.rows.values())):
            raise UsageError(f"{baseline_path} and {test_path} have no step in common")
        print(f"\nbaseline: {labels[0]}\ntest:     {labels[1]}")
        for metric, rows in comparison.rows.items():
            print(f"\n{format_table(metric, rows)}")
        print(f"\nsummary over {len(next(iter(comparison.rows.values())))} common steps")
        print(format_summary(comparison))
        checks = run_checks(
            comparison, assert_equal=args.assert_equal, rtol=args.rtol, atol=args.atol
        )
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    if not args.no_plot and plot(comparison, out / PLOT_NAME, labels=labels):
        print(f"plot: {args.output_folder / PLOT_NAME}")
    print("checks" if checks else "checks: none asked for (--assert-equal, --rtol, --atol)")
    for passed, what in checks:
        print(f"  {'PASS' if passed else 'FAIL'}  {what}")
    return 0 if all(passed for passed, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

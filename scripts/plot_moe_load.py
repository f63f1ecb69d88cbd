"""Plot mixture-of-experts load over steps from runs' metrics: one panel per run, one line per
MoE layer, the busiest expert's tokens over the mean (1 = perfectly balanced).

    python scripts/plot_moe_load.py OUT.png DUMP_FOLDER [DUMP_FOLDER ...] [--labels A B]

Each DUMP_FOLDER is a run's ``--job.dump_folder`` (its ``metrics.jsonl``; the per-layer
values ``moe_load_max_over_mean/<layer>`` are logged every ``--metrics.log_freq`` steps).
Needs matplotlib (``pip install -e '.[plot]'``).
"""

import argparse
import json
import sys
from pathlib import Path

PREFIX = "moe_load_max_over_mean/"


def load_curves(dump: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Per MoE layer: the logged steps and the load ratio at each."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.startswith(PREFIX):
                steps, values = curves.setdefault(key[len(PREFIX) :], ([], []))
                steps.append(record["step"])
                values.append(value)
    if not curves:
        sys.exit(f"{dump}/metrics.jsonl has no {PREFIX}* values: not a mixture-of-experts run")
    return curves


def plot(out: Path, dumps: list[Path], labels: list[str]):
    """Write the figure; returns it (tests read its axes)."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("matplotlib is not installed: no plot (get it with: pip install -e '.[plot]')")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dumps), figsize=(5 * len(dumps), 3.6), sharey=True)
    axes = list(axes) if len(dumps) > 1 else [axes]
    for ax, dump, label in zip(axes, dumps, labels, strict=True):
        for layer, (steps, values) in sorted(load_curves(dump).items()):
            ax.plot(steps, values, marker="o", markersize=3, label=layer)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(label)
        ax.set_xlabel("step")
    axes[0].set_ylabel("busiest expert's tokens / mean")
    axes[-1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("dumps", type=Path, nargs="+")
    parser.add_argument("--labels", nargs="+", help="panel titles (default: folder names)")
    args = parser.parse_args()
    labels = args.labels or [d.name for d in args.dumps]
    if len(labels) != len(args.dumps):
        sys.exit("--labels needs one label per dump folder")
    plot(args.out, args.dumps, labels)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

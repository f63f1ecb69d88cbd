"""Draw who runs what when for each pipeline schedule, and its ideal bubble.

    python scripts/plot_pipeline_schedules.py                      # P=2 ranks, m=4, figures
    python scripts/plot_pipeline_schedules.py --pp 4 --microbatches 8 16 --no-plot
    python scripts/plot_pipeline_schedules.py --out docs/images    # redraw docs/pipeline.md's

Figures go to ``outputs/pipeline_schedules/pipeline_<schedule>.png`` unless ``--out`` says.

The per-rank action lists come from torch (``torch.distributed.pipelining``'s schedule
lowering, through its ``_schedule_visualizer.get_schedule_ops``) for the multi-stage schedules;
GPipe and 1F1B run imperatively in torch (no action list), so their orders are written here as
those schedules define them. The timeline is then simulated with unit costs (forward 1, full
backward 2, input and weight halves 1 each) and the data dependencies between stages: the
bubble is the share of the timeline a rank has nothing to do.
"""

import argparse
from pathlib import Path

from torchtitan.distributed.pipeline_timeline import action_lists, bubble, simulate

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
SCHEDULES = {  # name: stages per rank
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "LoopedBFS": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}


def plot(schedule: str, timeline, path: Path, m: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(end for row in timeline for _, end, _ in row)
    fig, ax = plt.subplots(figsize=(max(8, span * 0.35) + 1.5, 0.6 * len(timeline) + 1.2))
    for r, row in enumerate(timeline):
        for start, end, (stage, kind, mb) in row:
            ax.barh(r, end - start, left=start, color=COLOURS[kind], edgecolor="white")
            ax.text(
                (start + end) / 2,
                r,
                f"{stage}:{mb}",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1)")
    ax.set_title(
        f"{schedule}: {len(timeline)} ranks, {m} micro-batches, bubble {bubble(timeline):.0%}"
        "  (labels: stage:micro-batch)"
    )
    kinds = sorted({a[1] for row in timeline for *_, a in row}, key="FBIW".index)
    names = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}
    ax.legend(
        handles=[Patch(color=COLOURS[k], label=names[k]) for k in kinds],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", type=Path, default=Path("outputs") / "pipeline_schedules")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    print(f"ideal bubble, {args.pp} ranks (1F1B-style formula (P-1)/(m+P-1) for reference)")
    print(f"{'schedule':>22} " + " ".join(f"{'m=' + str(m):>7}" for m in args.microbatches))
    formula = [(args.pp - 1) / (m + args.pp - 1) for m in args.microbatches]
    print(f"{'(P-1)/(m+P-1)':>22} " + " ".join(f"{b:>7.1%}" for b in formula))
    for schedule, per_rank in SCHEDULES.items():
        cells = []
        for i, m in enumerate(args.microbatches):
            try:
                timeline = simulate(
                    action_lists(schedule, args.pp, m, per_rank), args.pp * per_rank
                )
            except Exception as e:  # torch's lowering does not cover every (P, m)
                cells.append(f"{'n/a':>7}")
                print(f"  {schedule} m={m}: {type(e).__name__}: {str(e)[:80]}")
                continue
            cells.append(f"{bubble(timeline):>7.1%}")
            if i == 0 and not args.no_plot:
                args.out.mkdir(parents=True, exist_ok=True)
                plot(schedule, timeline, args.out / f"pipeline_{schedule}.png", m)
        print(f"{schedule:>22} " + " ".join(cells))


if __name__ == "__main__":
    main()

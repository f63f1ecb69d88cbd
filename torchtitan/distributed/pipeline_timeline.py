"""A model of a pipeline step: every rank's compute actions on a timeline with unit costs,
and the bubble that follows (the share of the timeline a rank has nothing to do).

The per-rank action lists come from torch's lowering of the multi-stage schedules
(``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``, a private API that may
change) or from a CSV schedule; GPipe and 1F1B run imperatively in torch (no action list), so
their orders are written here as those schedules define them. Costs: forward 1, full backward
2, the input and weight halves of a split backward 1 each; an action waits for its inputs (the
previous stage's forward, the next stage's backward, its own forward).
"""

import contextlib
import csv
import io
import re

Action = tuple[int, str, int]
"""(stage, kind F / B / I / W, micro-batch)"""

COST = {"F": 1, "B": 2, "I": 1, "W": 1}


def action_lists(schedule: str, pp: int, m: int, stages_per_rank: int) -> list[list[Action]]:
    """The compute actions of every rank, in the order the rank runs them."""
    if schedule == "GPipe":
        return [
            [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(pp)
        ]
    if schedule == "1F1B":
        lists = []
        for r in range(pp):
            warmup = min(m, pp - 1 - r)
            order = [(r, "F", i) for i in range(warmup)]
            for i in range(m - warmup):
                order += [(r, "F", warmup + i), (r, "B", i)]
            order += [(r, "B", i) for i in range(m - warmup, m)]
            lists.append(order)
        return lists
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    with contextlib.redirect_stdout(io.StringIO()):  # the lowering prints its progress
        ops = get_schedule_ops(schedule, pp, m, num_stages_per_rank=stages_per_rank)
    lists = []
    for rank_ops in ops:
        order = []
        for op in rank_ops:
            # DualPipeV overlaps a forward and a backward in one action: run them in turn.
            for sub in (getattr(op, "sub_actions", None) or [op]) if op is not None else []:
                kind = kinds.get(sub.computation_type.name)
                if kind is not None:
                    order.append((sub.stage_index, kind, sub.microbatch_index))
        lists.append(order)
    return lists


def simulate(lists: list[list[Action]], num_stages: int) -> list[list[tuple[float, float, Action]]]:
    """Start and end of every action: a rank runs its list in order, an action waits for its
    inputs (the previous stage's forward, the next stage's backward, its own forward)."""
    done: dict[Action, float] = {}
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in lists]
    position = [0] * len(lists)
    free = [0.0] * len(lists)

    def ready(action: Action) -> float | None:
        stage, kind, mb = action
        needs = []
        if kind == "F" and stage > 0:
            needs.append((stage - 1, "F", mb))
        if kind in "BI":
            needs.append((stage, "F", mb))
            if stage < num_stages - 1:
                after = (
                    (stage + 1, "B", mb)
                    if (stage + 1, "B", mb) in planned
                    else (stage + 1, "I", mb)
                )
                needs.append(after)
        if kind == "W":
            needs.append((stage, "I", mb))
        if any(n not in done for n in needs):
            return None
        return max((done[n] for n in needs), default=0.0)

    planned = {a for order in lists for a in order}
    while any(p < len(order) for p, order in zip(position, lists, strict=True)):
        progressed = False
        for r, order in enumerate(lists):
            while position[r] < len(order):
                action = order[position[r]]
                at = ready(action)
                if at is None:
                    break
                start = max(at, free[r])
                end = start + COST[action[1]]
                done[action] = free[r] = end
                timeline[r].append((start, end, action))
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the action lists wait on each other (deadlock)")
    return timeline


def bubble(timeline: list[list[tuple[float, float, Action]]]) -> float:
    """Idle share of the timeline, averaged over ranks."""
    span = max(end for row in timeline for _, end, _ in row)
    busy = sum(end - start for row in timeline for start, end, _ in row)
    return 1 - busy / (span * len(timeline))


def csv_action_lists(path: str) -> list[list[Action]]:
    """The compute actions of a CSV schedule (``--parallelism.pipeline_parallel_schedule_csv``)."""
    lists = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            cells = [re.match(r"^(\d+)([FBIW])(\d+)$", c.strip()) for c in row if c.strip()]
            if cells:
                lists.append([(int(m[1]), m[2], int(m[3])) for m in cells if m])
    return lists


def ideal_bubble(lists: list[list[Action]]) -> float:
    """The bubble of these action lists on the unit-cost timeline."""
    num_stages = 1 + max(stage for order in lists for stage, _, _ in order)
    return bubble(simulate(lists, num_stages))


def peak_in_flight(actions: list[Action], weight: dict[int, int]) -> int:
    """The most a rank holds at once of what forwards leave for their backward, running
    ``actions`` (its list) in order: a forward of stage s adds ``weight[s]`` (e.g. the
    activation bytes of one micro-batch through that stage); a full backward, or the weight
    half of a split one, releases it. The input half keeps it: the weight gradients still
    need the saved inputs of the linear layers."""
    held = peak = 0
    for stage, kind, _ in actions:
        if kind == "F":
            held += weight[stage]
        elif kind in ("B", "W"):
            held -= weight[stage]
        peak = max(peak, held)
    return peak

"""Pipeline parallelism without torch: schedule names, how many stages each rank holds and
which, and how a model's blocks are split into stages. The config pre-flight checks a layout
with these before any rank starts; ``pipeline_parallel.py`` builds it.

Stages are numbered in model order. With ``pp`` ranks and ``v`` stages per rank there are
``pp x v`` stages: loop-style schedules put stage ``s`` on rank ``s % pp``; V-shaped ones
(ZBVZeroBubble, DualPipeV) put stages ``r`` and ``2 pp - 1 - r`` on rank ``r``, so the first
and last stages share a rank.
"""

import csv
import dataclasses
import re
from pathlib import Path

from torchtitan.config.errors import ConfigError, did_you_mean
from torchtitan.tools.logging import logger

SCHEDULES_LOGGER = "torch.distributed.pipelining.schedules"
"""Where torch's multi-stage schedules log an error they catch, with their whole timetable."""

SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
SINGLE_STAGE = frozenset({"GPipe", "1F1B"})
V_SHAPED = frozenset({"ZBVZeroBubble", "DualPipeV"})
SPLIT_BACKWARD = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"})
"""Schedules that run backward as separate input- and weight-gradient passes."""

_FLAG = "--parallelism."


def stages_per_rank(schedule: str, *, n_layers: int, pp: int, layers_per_stage: int | None) -> int:
    """1 for single-stage schedules, 2 for the V-shaped ones; for the other multi-stage ones
    2, or ``n_layers / (layers_per_stage x pp)`` when the layers per stage are given."""
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED or layers_per_stage is None:
        return 2
    return max(1, n_layers // (layers_per_stage * pp))


def stage_ids(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages rank ``pp_rank`` of the ``pp`` pipeline ranks holds, in model order."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def split_blocks(
    n_blocks: int,
    num_stages: int,
    *,
    layers_per_stage: int | None = None,
    first: tuple[str, ...] = (),
    last: tuple[str, ...] = (),
    first_cost: float = 1.0,
    last_cost: float = 1.0,
    blocks: str = "layers",
) -> list[list[str]]:
    """Module names of each stage: ``blocks.0 .. blocks.{n-1}`` cut in order, with ``first``
    (e.g. the embeddings) on the first stage and ``last`` (final norm, output) on the last.

    The default split balances compute: ``first`` and ``last`` cost ``first_cost`` and
    ``last_cost`` blocks (the model knows: an embedding lookup costs almost nothing, an output
    projection over a large vocabulary several blocks), and each stage ends where the running
    cost is nearest to its even share. ``layers_per_stage`` instead puts exactly that many
    blocks on every stage.
    """
    if layers_per_stage is not None:
        if layers_per_stage < 1 or layers_per_stage * num_stages != n_blocks:
            raise ConfigError(
                f"{_FLAG}pipeline_parallel_layers_per_stage={layers_per_stage} x {num_stages} "
                f"stages != {n_blocks} layers; pick a value that divides the layers into the "
                "stages (stages = pipeline_parallel_degree x stages per rank)"
            )
        counts = [layers_per_stage] * num_stages
    else:
        head = first_cost if first else 0.0
        share = (n_blocks + head + (last_cost if last else 0.0)) / num_stages
        ends, previous = [], 0
        for s in range(1, num_stages):
            # Blocks before the end of stage s - 1, nearest to its share of the cost.
            end = round(s * share - head)
            # A stage without the first or last modules needs a block; leave one per stage after.
            lowest = previous + (0 if s == 1 and first else 1)
            end = min(max(end, lowest), n_blocks - (num_stages - s - (1 if last else 0)))
            if end < lowest:
                raise ConfigError(
                    f"{num_stages} pipeline stages need more than {n_blocks} layers; lower "
                    f"{_FLAG}pipeline_parallel_degree or use a schedule with fewer stages per rank"
                )
            ends.append(end)
            previous = end
        bounds = [0, *ends, n_blocks]
        counts = [bounds[i + 1] - bounds[i] for i in range(num_stages)]
        if not last and counts[-1] < 1:
            raise ConfigError(f"{num_stages} pipeline stages need more than {n_blocks} layers")
    names, start = [], 0
    for s, count in enumerate(counts):
        stage = [f"{blocks}.{i}" for i in range(start, start + count)]
        start += count
        names.append(
            ([*first] if s == 0 else []) + stage + ([*last] if s == num_stages - 1 else [])
        )
    return names


def decoder_stages_by_name(parts: list[str], n_layers: int) -> list[list[str]]:
    """``--parallelism.module_fqns_per_model_part`` for a decoder whose top-level modules are
    ``tok_embeddings``, ``layers.<i>``, ``norm`` and ``output``: parsed and checked."""
    names = parse_module_names(parts)
    blocks = [f"layers.{i}" for i in range(n_layers)]
    check_module_names(names, ["tok_embeddings", *blocks, "norm", "output"])
    return names


def check_module_names(names_per_stage: list[list[str]], units: list[str]) -> None:
    """Each of the model's ``units`` (top-level modules and blocks) on exactly one stage, and
    nothing else."""
    named = [n for stage in names_per_stage for n in stage]
    unknown = sorted(set(named) - set(units))
    missing = [u for u in units if u not in named]
    repeated = sorted({n for n in named if named.count(n) > 1})
    every = f"list each of {', '.join(units)} once, in model order"
    if unknown:
        raise ConfigError(
            f"{_FLAG}module_fqns_per_model_part: no module named {', '.join(unknown)}"
            f"{did_you_mean(unknown[0], units)}; {every}"
        )
    if missing:
        raise ConfigError(
            f"{_FLAG}module_fqns_per_model_part: {', '.join(missing)} on no stage; {every}"
        )
    if repeated:
        raise ConfigError(
            f"{_FLAG}module_fqns_per_model_part: {', '.join(repeated)} on several stages"
        )
    # Stages run one after another: read in order they must be the model's own order (else
    # the final norm could run mid-model, or blocks swap places, and still train).
    for name, unit in zip(named, units, strict=True):
        if name != unit:
            raise ConfigError(
                f"{_FLAG}module_fqns_per_model_part: {name} comes where the model has {unit}; "
                f"{every}, stage after stage"
            )


def parse_module_names(parts: list[str]) -> list[list[str]]:
    """``--parallelism.module_fqns_per_model_part "a,b" "c,d"`` -> ``[["a", "b"], ["c", "d"]]``."""
    return [[name.strip() for name in part.split(",") if name.strip()] for part in parts]


_ACTION = re.compile(r"^(\d+)([A-Z]+)(\d*)$")
_CSV_FLAG = f"{_FLAG}pipeline_parallel_schedule_csv"


def read_csv_schedule(path: str, pp: int) -> tuple[list[list[int]], int, bool]:
    """From a compute-only CSV schedule: the stages of each rank (in model order), the number
    of micro-batches it schedules, and whether it splits backward (``I`` / ``W`` actions)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{_CSV_FLAG} {path} does not exist; pass a CSV file")
    with file.open(newline="") as f:
        rows = [[cell.strip() for cell in row if cell.strip()] for row in csv.reader(f)]
    blank = [i for i, row in enumerate(rows) if not row]
    if blank:  # torch reads every row of the file as a pipeline rank, a blank one too
        raise ConfigError(
            f"{_CSV_FLAG} {path}: line {blank[0] + 1} is blank, and every line is a pipeline "
            "rank; remove it"
        )
    if len(rows) != pp:
        raise ConfigError(
            f"{_CSV_FLAG} {path} has {len(rows)} rows, one per pipeline rank is needed: "
            f"{pp} for {_FLAG}pipeline_parallel_degree {pp}"
        )
    stages: list[list[int]] = []
    microbatches, kinds = set(), set()
    actions: list[tuple[int, str, int]] = []
    for rank, row in enumerate(rows):
        mine = set()
        for cell in row:
            match = _ACTION.match(cell)
            if match is None or match.group(2) not in ("F", "B", "I", "W") or not match.group(3):
                raise ConfigError(
                    f"{_CSV_FLAG} {path}: {cell!r} in row {rank} is not an action like 0F1 "
                    "(stage, F/B/I/W, micro-batch)"
                )
            stage, kind, microbatch = int(match.group(1)), match.group(2), int(match.group(3))
            mine.add(stage)
            kinds.add(kind)
            microbatches.add(microbatch)
            actions.append((stage, kind, microbatch))
        stages.append(sorted(mine))
    flat = sorted(s for row in stages for s in row)
    if flat != list(range(len(flat))) or len({len(row) for row in stages}) != 1:
        raise ConfigError(
            f"{_CSV_FLAG} {path}: every stage 0..N-1 must appear on exactly one rank and every "
            f"rank must hold as many stages; found {stages}"
        )
    _check_csv_actions(path, actions, num_stages=len(flat), microbatches=len(microbatches))
    return stages, len(microbatches), bool(kinds & {"I", "W"})


def _check_csv_actions(
    path: str, actions: list[tuple[int, str, int]], *, num_stages: int, microbatches: int
) -> None:
    """Every stage runs each micro-batch 0..n-1 (``n`` distinct numbers: a gap leaves one
    out) once forward and once backward (``B``, or both halves ``I`` and ``W``), as torch's
    runtime checks inside every rank."""
    for stage in range(num_stages):
        for microbatch in range(microbatches):
            done = [k for s, k, m in actions if s == stage and m == microbatch]
            backward = sorted(k for k in done if k != "F")
            if done.count("F") != 1 or backward not in (["B"], ["I", "W"]):
                raise ConfigError(
                    f"{_CSV_FLAG} {path}: stage {stage} runs micro-batch {microbatch} as "
                    f"{' '.join(f'{stage}{k}{microbatch}' for k in done) or 'nothing'}; every "
                    f"stage needs, for each of the {microbatches} micro-batches 0..{microbatches - 1}, "
                    "one F and one B (or one I and one W)"
                )


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Which stages each pipeline rank holds, from the schedule or a CSV schedule."""

    stages_by_rank: list[list[int]]
    split_backward: bool
    csv_microbatches: int | None = None
    """Micro-batches a CSV schedule is written for (``None`` for a named schedule)."""

    @property
    def num_stages(self) -> int:
        return sum(len(row) for row in self.stages_by_rank)


def pipeline_layout(parallelism, n_layers: int) -> PipelineLayout:
    """The layout that ``--parallelism.pipeline_parallel_*`` asks for (a ``Parallelism``)."""
    pp = parallelism.pipeline_parallel_degree
    if parallelism.pipeline_parallel_schedule_csv:
        stages, microbatches, split = read_csv_schedule(
            parallelism.pipeline_parallel_schedule_csv, pp
        )
        return PipelineLayout(stages, split, microbatches)
    schedule = parallelism.pipeline_parallel_schedule
    per_rank = stages_per_rank(
        schedule,
        n_layers=n_layers,
        pp=pp,
        layers_per_stage=parallelism.pipeline_parallel_layers_per_stage,
    )
    by_rank = [stage_ids(schedule, r, pp, per_rank) for r in range(pp)]
    return PipelineLayout(by_rank, schedule in SPLIT_BACKWARD)


def action_lists(layout: PipelineLayout, parallelism, local_batch_size: int) -> list:
    """Every rank's compute actions of one accumulation batch under this layout (for the
    timeline model of ``pipeline_timeline``; imports torch for the named multi-stage ones)."""
    from torchtitan.distributed import pipeline_timeline

    if parallelism.pipeline_parallel_schedule_csv:
        return pipeline_timeline.csv_action_lists(parallelism.pipeline_parallel_schedule_csv)
    return pipeline_timeline.action_lists(
        parallelism.pipeline_parallel_schedule,
        parallelism.pipeline_parallel_degree,
        local_batch_size // parallelism.pipeline_parallel_microbatch_size,
        len(layout.stages_by_rank[0]),
    )


def log_ideal_bubble(parallelism, n_layers: int, local_batch_size: int) -> float | None:
    """The bubble of a pipeline layout on the unit-cost timeline, logged once; ``None`` where
    the schedule cannot be lowered (a private torch API): the run goes on without it."""
    from torchtitan.distributed import pipeline_timeline

    p = parallelism
    layout = pipeline_layout(p, n_layers)
    try:
        bubble = pipeline_timeline.ideal_bubble(action_lists(layout, p, local_batch_size))
    except Exception as e:  # a model of the step, never a reason to stop training
        logger.warning(f"Pipeline: ideal bubble unknown ({type(e).__name__}: {e})")
        return None
    logger.info(
        f"Pipeline: {layout.num_stages} stages on {p.pipeline_parallel_degree} ranks, "
        f"{local_batch_size // p.pipeline_parallel_microbatch_size} micro-batches per "
        f"accumulation batch; ideal bubble {bubble:.1%} (unit-cost timeline of the "
        "schedule's actions: scripts/plot_pipeline_schedules.py draws it)"
    )
    return bubble

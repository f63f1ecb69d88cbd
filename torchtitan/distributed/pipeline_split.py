"""Pipeline parallelism without torch: schedule names, how many stages each rank holds and
which, and how a model's blocks are split into stages. The config pre-flight checks a layout
with these before any rank starts; ``pipeline_parallel.py`` builds it.

Stages are numbered in model order. With ``pp`` ranks and ``v`` stages per rank there are
``pp x v`` stages: loop-style schedules put stage ``s`` on rank ``s % pp``; V-shaped ones
(ZBVZeroBubble, DualPipeV) put stages ``r`` and ``2 pp - 1 - r`` on rank ``r``, so the first
and last stages share a rank.
"""

from torchtitan.config.errors import ConfigError

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
    blocks: str = "layers",
) -> list[list[str]]:
    """Module names of each stage: ``blocks.0 .. blocks.{n-1}`` cut in order, with ``first``
    (e.g. the embeddings) on the first stage and ``last`` (final norm, output) on the last.

    An even split counts ``first`` and ``last`` as one block each (they cost about as much
    as one: the output projection is a large matmul), and gives any remainder to the earlier
    stages. ``layers_per_stage`` instead puts exactly that many blocks on every stage.
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
        units = n_blocks + (1 if first else 0) + (1 if last else 0)
        base, extra = divmod(units, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
        if first:
            counts[0] -= 1
        if last:
            counts[-1] -= 1
        if base < 1 or min(counts) < 0 or (num_stages > 2 and min(counts[1:-1]) < 1):
            raise ConfigError(
                f"{num_stages} pipeline stages need more than {n_blocks} layers; lower "
                f"{_FLAG}pipeline_parallel_degree or use a schedule with fewer stages per rank"
            )
    names, start = [], 0
    for s, count in enumerate(counts):
        stage = [f"{blocks}.{i}" for i in range(start, start + count)]
        start += count
        names.append(
            ([*first] if s == 0 else []) + stage + ([*last] if s == num_stages - 1 else [])
        )
    return names


def parse_module_names(parts: list[str]) -> list[list[str]]:
    """``--parallelism.module_fqns_per_model_part "a,b" "c,d"`` -> ``[["a", "b"], ["c", "d"]]``."""
    return [[name.strip() for name in part.split(",") if name.strip()] for part in parts]

"""How many sequences each optimizer step trains on (a fixed global batch, or a batch-size
ramp), and which steps train at all (``--training.skip_steps`` drops some).

A ramp starts at ``--training.global_batch_size_start`` sequences per step and adds
``--training.global_batch_size_increment`` each time another equal share of
``--training.global_batch_size_ramp_sequences`` has been trained on, until it reaches
``--training.global_batch_size`` (Megatron-LM's ``--rampup-batch-size`` rule). The steps'
sizes are counted in sequences, not in accumulation batches, so every layout of the same flags
trains the same sequences at every step; each size must split into whole accumulation batches
of ``local_batch_size`` on every data-parallel rank. The schedule is a function of the step:
a resumed run continues it where the step is, and nothing is checkpointed. Torch-free: the
pre-flight builds it to check the flags.
"""

import bisect
import math
import re
from dataclasses import dataclass

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Training
from torchtitan.distributed.parallel_dims import ParallelDims


def ramp_stages(
    start: int, increment: int, full: int, sequences: int
) -> tuple[tuple[int, int], ...]:
    """``(first step, global batch)`` of each size a ramp takes, the last the full batch: the
    batch of a step is ``start + increment x floor(trained x n / sequences)`` (``trained``: the
    sequences of the steps before it, ``n``: the number of increments), at most ``full``. A
    size can be passed over when one step of the previous size trains more than a share.
    Exact integers: Megatron-LM divides in floating point, which at an exact share boundary can
    land one increment lower."""
    if start >= full:
        return ((1, full),)
    n = (full - start) // increment
    stages, step, trained, j = [], 1, 0, 0
    while j < n:
        batch = start + increment * j
        stages.append((step, batch))
        needed = -(-(j + 1) * sequences // n)  # sequences trained when the next size starts
        steps = -(-(needed - trained) // batch)
        step, trained = step + steps, trained + steps * batch
        j = min(trained * n // sequences, n)
    stages.append((step, full))
    return tuple(stages)


@dataclass(frozen=True)
class BatchSchedule:
    """Sequences per step over all data-parallel ranks, as ``stages``: ``(first step, global
    batch)`` from step 1 on, the last holding to the end; each batch a multiple of
    ``local_batch_size x dp_degree`` (one accumulation batch on every rank)."""

    local_batch_size: int
    dp_degree: int
    stages: tuple[tuple[int, int], ...]
    skip: tuple[tuple[int, int], ...] = ()
    """Ranges of steps (first, last) whose batches are read and dropped."""

    @classmethod
    def from_config(cls, t: Training, dims: ParallelDims) -> "BatchSchedule":
        """The schedule of ``--training.*``; ``ConfigError`` names the flag that does not fit."""
        check_flags(t)
        dims.grad_accum_steps(t.local_batch_size, t.global_batch_size)  # refuses a bad one
        full = dims.global_batch_size(t.local_batch_size, t.global_batch_size)
        unit = t.local_batch_size * dims.dp_degree
        skip = step_ranges(t.skip_steps)
        start = t.global_batch_size_start
        if start == -1:
            return cls(t.local_batch_size, dims.dp_degree, ((1, full),), skip)
        if start > full:
            raise ConfigError(
                f"--training.global_batch_size_start={start} must be at most the batch it ramps "
                f"up to, --training.global_batch_size (-1: local_batch_size x data-parallel "
                f"degree = {full})"
            )
        increment = ramp_increment(t, full)
        _check_increment(increment, start, full)
        for flag, value in (("start", start), ("increment", increment)):
            if value % unit:  # (the default increment always is: a gcd of two multiples)
                raise ConfigError(
                    f"--training.global_batch_size_{flag}={value} must be a multiple of "
                    f"--training.local_batch_size x data-parallel degree = {t.local_batch_size} x "
                    f"{dims.dp_degree} = {unit}, so that each step's batch splits into whole "
                    "accumulation batches on every rank"
                )
        stages = ramp_stages(start, increment, full, t.global_batch_size_ramp_sequences)
        return cls(t.local_batch_size, dims.dp_degree, stages, skip)

    @property
    def ramps(self) -> bool:
        return len(self.stages) > 1

    @property
    def last(self) -> int:
        """Accumulation batches per rank of the full batch."""
        return self.stages[-1][1] // self._unit

    @property
    def _unit(self) -> int:
        return self.local_batch_size * self.dp_degree

    def global_batch(self, step: int) -> int:
        """Sequences of (1-based) ``step`` over all data-parallel ranks."""
        return _size_at(self.stages, step)

    def accumulation(self, step: int) -> int:
        """Accumulation batches of ``step`` on each data-parallel rank."""
        return self.global_batch(step) // self._unit

    def batches_through(self, step: int) -> int:
        """Accumulation batches of steps 1 .. ``step`` on each rank (0 for ``step`` <= 0)."""
        return sequences_through(self.stages, step) // self._unit

    def trained_through(self, step: int) -> int:
        """Accumulation batches of steps 1 .. ``step`` that train (the ETA's work: a skipped
        step only reads its data)."""
        total = self.batches_through(step)
        for first, last in self.skip:
            if first <= step:
                total -= self.batches_through(min(last, step)) - self.batches_through(first - 1)
        return total

    def skipped(self, step: int) -> tuple[int, int] | None:
        """The range of ``--training.skip_steps`` holding ``step`` (``None``: it trains)."""
        return next(((a, b) for a, b in self.skip if a <= step <= b), None)

    def skip_news(self, step: int, first_step: int, stop: int) -> tuple[int, str] | None:
        """The last step of the skipped range ``step`` opens and its console line, at the
        range's first step or the first step of a run resumed inside it (``None``: nothing new
        to say; ``first_step``: the step the run started after, ``stop``: its last)."""
        found = self.skipped(step)
        if found is None or step not in (found[0], first_step + 1):
            return None
        last = min(found[1], stop)
        span = f"Step {step}" if last == step else f"Steps {step}-{last}"
        return last, f"{span}: batches read and dropped, untrained (--training.skip_steps)"

    def record(self, step: int, tokens_seen: int) -> dict[str, int]:
        """What a logged record adds under a ramp (a step's size varies): the step's global
        batch and the tokens trained on so far."""
        if not self.ramps:
            return {}
        return {"global_batch_size": self.global_batch(step), "tokens_seen": tokens_seen}

    def describe(self, seq_len: int) -> str:
        """The batch as the start-up line says it."""
        per_rank = f"accumulation batch(es) of {self.local_batch_size} per rank"
        if not self.ramps:
            return f"global batch {self.stages[0][1]} x {seq_len} tokens ({self.last} {per_rank})"
        sizes = [f"{batch} from step {first}" for first, batch in self.stages]
        if len(sizes) > 6:
            sizes = [*sizes[:3], f"... ({len(sizes) - 4} more)", sizes[-1]]
        return (
            f"global batch ramping up, x {seq_len} tokens: {', '.join(sizes)} (up to {self.last} "
            f"{per_rank})"
        )


def sequences_through(stages: tuple[tuple[int, int], ...], step: int) -> int:
    """Sequences of steps 1 .. ``step`` over all ranks in ``(first step, batch)`` stages (0 for
    ``step`` <= 0)."""
    total = 0
    ends = [first for first, _ in stages[1:]] + [math.inf]
    for (first, batch), after in zip(stages, ends, strict=True):
        steps = min(step + 1, after) - first
        if steps <= 0:
            break
        total += steps * batch
    return total


def step_reaching(stages: tuple[tuple[int, int], ...], sequences: float) -> int:
    """The first step through which at least ``sequences`` sequences are trained (0 when none
    need be)."""
    if sequences <= 0:
        return 0
    ends = [first for first, _ in stages[1:]] + [math.inf]
    for (first, batch), after in zip(stages, ends, strict=True):
        step = first - 1 + math.ceil((sequences - sequences_through(stages, first - 1)) / batch)
        if step < after:
            return step
    raise AssertionError("the last stage lasts for ever")


def stages_for(t: Training, full: int) -> tuple[tuple[int, int], ...]:
    """The ``(first step, global batch)`` stages of the ``--training.global_batch_size*`` flags
    at a full batch of ``full`` sequences."""
    if t.global_batch_size_start == -1:
        return ((1, full),)
    return ramp_stages(
        t.global_batch_size_start, ramp_increment(t, full), full, t.global_batch_size_ramp_sequences
    )


def ramp_increment(t: Training, full: int) -> int:
    """``--training.global_batch_size_increment``, or its default: the largest size dividing
    both the start and the full batch."""
    if t.global_batch_size_increment != -1:
        return t.global_batch_size_increment
    return math.gcd(t.global_batch_size_start, full)


def ramp_end(t: Training) -> int | None:
    """The first step at the full batch when the flags alone say it (an explicit
    ``--training.global_batch_size``), else ``None``."""
    if t.global_batch_size_start == -1 or t.global_batch_size == -1:
        return None
    return stages_for(t, t.global_batch_size)[-1][0]


def batch_at(t: Training, step: int) -> int | None:
    """The global batch of ``step`` by the flags alone (``None``: ``--training.global_batch_size``
    is -1, so it depends on the data-parallel degree)."""
    if t.global_batch_size == -1:
        return None
    return _size_at(stages_for(t, t.global_batch_size), step)


def _size_at(stages: tuple[tuple[int, int], ...], step: int) -> int:
    """The batch of ``step`` in ``(first step, batch)`` stages (step 1 for any earlier one)."""
    return stages[bisect.bisect_right(stages, (max(step, 1), math.inf)) - 1][1]


def resumed_batch_note(current: Training, saved: Training, step: int) -> str | None:
    """One line when a run resumed at ``step`` trains the next step on another global batch than
    the checkpoint's run would have (its batch or ramp flags changed); ``None`` otherwise."""
    now, then = batch_at(current, step + 1), batch_at(saved, step + 1)
    if now is None or then is None or now == then:
        return None
    return (
        f"Global batch: the checkpoint's run would train step {step + 1} on {then} sequences; "
        f"this run trains it on {now}, as its --training.global_batch_size* flags say"
    )


def step_ranges(entries: list[str]) -> tuple[tuple[int, int], ...]:
    """``--training.skip_steps`` entries (``N`` or ``FIRST-LAST``) as (first, last) ranges;
    ``ConfigError`` names the entry that does not parse."""
    ranges = []
    for entry in entries:
        found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", entry)
        if found is None:
            raise ConfigError(
                f"--training.skip_steps entry {entry!r} is not a step N or a range FIRST-LAST"
            )
        a = int(found[1])
        b = a if found[2] is None else int(found[2])
        if not 1 <= a <= b:
            raise ConfigError(
                f"--training.skip_steps entry {entry!r} must be steps from 1 on, first <= last"
            )
        ranges.append((a, b))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):  # overlapping or adjacent ranges are one (one line, one event)
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return tuple(merged)


def check_flags(t: Training) -> None:
    """The rules that need no data-parallel degree (the pre-flight runs them without a world
    size); ``ConfigError`` naming the flag."""
    step_ranges(t.skip_steps)
    start, full = t.global_batch_size_start, t.global_batch_size
    increment, sequences = t.global_batch_size_increment, t.global_batch_size_ramp_sequences
    if start == -1:
        for flag, value, off in (("increment", increment, -1), ("ramp_sequences", sequences, 0)):
            if value != off:
                raise ConfigError(
                    f"--training.global_batch_size_{flag}={value} needs "
                    "--training.global_batch_size_start (the batch at step 1)"
                )
        return
    flag = f"--training.global_batch_size_start={start}"
    if start < 1:
        raise ConfigError(f"{flag} must be -1 (no ramp) or >= 1")
    if sequences < 1:
        raise ConfigError(
            f"{flag} needs --training.global_batch_size_ramp_sequences >= 1, the sequences "
            "trained while the batch grows"
        )
    if increment != -1 and increment < 1:
        raise ConfigError(
            f"--training.global_batch_size_increment={increment} must be -1 (the default) or >= 1"
        )
    if full == -1:
        return
    if start > full:
        raise ConfigError(
            f"{flag} must be at most --training.global_batch_size={full}, the batch it ramps up to"
        )
    _check_increment(ramp_increment(t, full), start, full)


def _check_increment(increment: int, start: int, full: int) -> None:
    if (full - start) % increment:
        raise ConfigError(
            f"--training.global_batch_size_increment={increment} must divide "
            f"--training.global_batch_size - global_batch_size_start = {full} - {start}"
        )

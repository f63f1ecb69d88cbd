"""How many accumulation batches each optimizer step runs: a fixed number, or a batch-size ramp.

A ramp (``--training.global_batch_size_start`` and ``--training.global_batch_size_ramp_steps``)
starts small and grows linearly with the step to ``--training.global_batch_size``, in whole
accumulation batches per data-parallel rank, so every rank runs the same number and every
layout of the same global batch sees the same sequences. The count is a function of the step
alone: a resumed run continues the ramp where the step is, and nothing is checkpointed.
Torch-free: the pre-flight builds it to check the flags.
"""

from dataclasses import dataclass

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Training
from torchtitan.distributed.parallel_dims import ParallelDims


@dataclass(frozen=True)
class BatchSchedule:
    """Accumulation batches per step on each data-parallel rank: ``first`` at step 1, growing
    linearly to ``last`` at step ``ramp_steps + 1`` and after (rounded down to whole batches)."""

    local_batch_size: int
    dp_degree: int
    first: int
    last: int
    ramp_steps: int = 0

    @classmethod
    def from_config(cls, t: Training, dims: ParallelDims) -> "BatchSchedule":
        """The schedule of ``--training.*``; ``ConfigError`` names the flag that does not fit."""
        check_ramp_flags(t)
        last = dims.grad_accum_steps(t.local_batch_size, t.global_batch_size)
        start = t.global_batch_size_start
        if start == -1:
            return cls(t.local_batch_size, dims.dp_degree, last, last)
        unit = t.local_batch_size * dims.dp_degree
        if start % unit:
            raise ConfigError(
                f"--training.global_batch_size_start={start} must be a multiple of "
                f"--training.local_batch_size x data-parallel degree = {t.local_batch_size} x "
                f"{dims.dp_degree} = {unit}"
            )
        if start > unit * last:
            raise ConfigError(
                f"--training.global_batch_size_start={start} must be at most the batch it ramps "
                f"up to, --training.global_batch_size (-1: local_batch_size x data-parallel "
                f"degree = {unit})"
            )
        return cls(
            t.local_batch_size, dims.dp_degree, start // unit, last, t.global_batch_size_ramp_steps
        )

    @property
    def ramps(self) -> bool:
        return self.first != self.last

    def accumulation(self, step: int) -> int:
        """Accumulation batches of (1-based) ``step`` on each data-parallel rank."""
        if step > self.ramp_steps:
            return self.last
        return self.first + (self.last - self.first) * (step - 1) // self.ramp_steps

    def global_batch(self, step: int) -> int:
        """Sequences of ``step`` over all data-parallel ranks."""
        return self.accumulation(step) * self.local_batch_size * self.dp_degree

    def batches_through(self, step: int) -> int:
        """Accumulation batches of steps 1 .. ``step`` on each rank (0 for ``step`` <= 0)."""
        step = max(step, 0)
        ramp = min(step, self.ramp_steps)
        total = self.first * ramp + self.last * (step - ramp)
        # The ramp adds floor(grow x k / ramp_steps) at step k + 1: count, for each j, the
        # steps where that is at least j (O(grow), not O(steps)).
        grow = self.last - self.first
        for j in range(1, grow + 1):
            reached = -(-j * self.ramp_steps // grow)  # first k with grow x k >= j x ramp_steps
            if reached >= ramp:
                break
            total += ramp - reached
        return total

    def describe(self, seq_len: int) -> str:
        """The batch as the start-up line says it."""
        per_rank = f"accumulation batch(es) of {self.local_batch_size} per rank"
        if not self.ramps:
            return (
                f"global batch {self.global_batch(1)} x {seq_len} tokens ({self.last} {per_rank})"
            )
        return (
            f"global batch {self.global_batch(1)} -> {self.global_batch(self.ramp_steps + 1)} "
            f"x {seq_len} tokens over steps 1-{self.ramp_steps + 1} ({self.first} -> {self.last} "
            f"{per_rank})"
        )


def check_ramp_flags(t: Training) -> None:
    """The ramp's rules that need no data-parallel degree (the pre-flight runs them without a
    world size); ``ConfigError`` naming the flag."""
    start, ramp, full = (
        t.global_batch_size_start,
        t.global_batch_size_ramp_steps,
        t.global_batch_size,
    )
    flag = f"--training.global_batch_size_start={start}"
    if start == -1:
        if ramp != 0:
            raise ConfigError(
                f"--training.global_batch_size_ramp_steps={ramp} needs "
                "--training.global_batch_size_start (the batch at step 1)"
            )
        return
    if start < 1:
        raise ConfigError(f"{flag} must be -1 (no ramp) or >= 1")
    if ramp < 1:
        raise ConfigError(
            f"{flag} needs --training.global_batch_size_ramp_steps >= 1, the steps it grows over"
        )
    if full != -1 and start > full:
        raise ConfigError(
            f"{flag} must be at most --training.global_batch_size={full}, the batch it ramps up to"
        )

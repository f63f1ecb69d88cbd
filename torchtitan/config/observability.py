"""The config sections of what a run reports and how it is debugged: profiling, metrics,
communication timeouts and modes, debugging aids. Re-exported by ``job_config``; imports no
torch."""

from dataclasses import dataclass
from typing import Literal


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (Chrome format, one per rank)."""

    save_traces_folder: str = "profile_traces"
    """Folder under ``job.dump_folder`` for traces."""

    profile_freq: int = 10
    """Profile every N steps."""

    profiler_warmup: int = 3
    """Profiler warm-up steps in each cycle."""

    profiler_active: int = 1
    """Profiler recorded steps in each cycle."""

    enable_memory_snapshot: bool = False
    """Dump CUDA allocator snapshots every ``profile_freq`` steps and on out-of-memory (on CPU:
    the profiler's memory timeline)."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder under ``job.dump_folder`` for memory snapshots."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every N steps (and always at step 1 and the last step)."""

    enable_tensorboard: bool = False
    """Write TensorBoard event files."""

    save_tb_folder: str = "tb"
    """Folder under ``job.dump_folder`` for TensorBoard logs."""

    enable_wandb: bool = False
    """Log to Weights & Biases (``WANDB_MODE=offline`` works without network)."""

    enable_color_printing: bool = True
    """Color the console step line."""

    save_for_all_ranks: bool = False
    """Write TensorBoard/W&B logs from every rank, not only the logging rank."""

    peak_flops: float | None = None
    """Peak dense bf16 FLOP/s of one device, for MFU; by default looked up for known GPUs."""

    report: bool = True
    """At the end of a run, write ``report.png`` (loss, grad norm, tokens/s, MFU, memory
    against steps) and ``report.txt`` into ``job.dump_folder``; also on demand with
    ``python -m torchtitan.tools.report DUMP_FOLDER``."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of process-group initialisation and the first step's collectives."""

    train_timeout_seconds: int = 100
    """Collective timeout after the first step."""

    trace_buf_size: int = 20000
    """Flight-recorder entries kept per rank (0 disables)."""

    mode: Literal["default", "fake_backend", "local_tensor"] = "default"
    """``default``: real collectives (torchrun). ``fake_backend``: one process plays one rank
    (``RANK``) of a ``WORLD_SIZE`` job with no-op collectives, to validate a config and
    estimate its memory; numbers are meaningless. ``local_tensor``: one process simulates
    every rank with real numerics. ``run_train.sh`` sets this from ``COMM_MODE``."""

    dry_run_steps: int = 1
    """Training steps a ``fake_backend`` run takes after building (0: build and estimate only)."""

    fake_compute: Literal["auto", "real", "fake"] = "auto"
    """How a ``fake_backend`` run steps: ``real`` tensors, ``fake`` tensors (shapes only, no
    memory, no compute), or ``auto``: fake when one rank's step is too big for this host."""


@dataclass
class Debug:
    seed: int | None = None
    """Seed for model init and RNG; all data/tensor-parallel ranks share it."""

    deterministic: bool = False
    """Use deterministic algorithms (bitwise-reproducible runs, slower)."""

    deterministic_warn_only: bool = False
    """Warn instead of failing when an op has no deterministic implementation."""

    comm_trace_step: int = 0
    """Trace the collectives of this step per module with ``CommDebugMode`` (0: off); tables
    and JSON go to ``<dump_folder>/comm_trace/``."""

    comm_trace_noise_level: int = 1
    """Detail of the written trace: 0 module-level counts, 1 adds DTensor ops, 2 adds their
    shardings, 3 adds every op."""

    host_sync_step: int = 0
    """List where this training step reads device values on the host (``.item()``,
    ``.tolist()``, data-sized ops such as ``nonzero``), each with the line that asked (0:
    off); tables go to ``<dump_folder>/host_syncs/``. On a CPU it lists the reads that would
    wait for a GPU."""

    skip_nonfinite_steps: bool = False
    """Skip the update of a step whose gradient norm is NaN or infinite (counted as
    ``skipped_steps`` in the metrics) instead of stopping the run."""

    detect_anomaly: bool = False
    """Find where a step first goes NaN or infinite, and stop there (exit 3) naming it: every
    module's output and the gradient reaching it are checked (the first to turn finite inputs
    into NaN/inf is named, with its parameters' largest magnitude), and where gradients are
    plain tensors autograd's anomaly mode names the backward op that returned NaN with the
    model line of its forward. A host read per module, so slower steps: for a rerun from the
    last good checkpoint. Not with ``--compile.enable``."""

    device_memory_gib: float = 80.0
    """Memory of one accelerator, against which ``COMM_MODE=fake_backend`` checks its
    per-rank memory estimate."""

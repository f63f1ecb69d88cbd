"""The config sections of how the model runs across devices: parallelism degrees and
layouts, activation checkpointing, compile, float8. Re-exported by ``job_config``; imports no
torch."""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP, or the replicate dimension of HSDP)."""

    data_parallel_shard_degree: int = -1
    """Ranks that shard the model with FSDP; -1 takes whatever the other degrees leave."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward (``always``), keep them (``never``), or let the
    framework choose (``default``: free them, except the last block's, which backward needs
    first)."""

    fsdp_prefetch: int = 0
    """Blocks whose FSDP all-gather is issued ahead of their use: 0 keeps FSDP2's own order
    (in forward a block's gather starts when the block does, in backward one block ahead);
    N >= 1 starts the next N blocks' gathers when a block starts, in forward and backward."""

    fsdp_impl: Literal["auto", "fsdp2", "simple"] = "auto"
    """How parameters are sharded over data-parallel ranks: ``fsdp2`` (``fully_shard``: per-block
    bucketed all-gathers with prefetch), ``simple`` (each parameter a DTensor gathered when a
    module reads it; runs under ``COMM_MODE=local_tensor``, where FSDP2 cannot), or ``auto``:
    ``simple`` under ``local_tensor``, otherwise ``fsdp2``."""

    tensor_parallel_degree: int = 1
    """Ranks that split each layer's matmuls (TP); must divide heads, KV heads, FFN width and
    vocabulary."""

    enable_sequence_parallel: bool = True
    """Shard norms and dropout along the sequence in TP regions."""

    disable_loss_parallel: bool = False
    """Gather logits before the loss instead of a vocab-sharded cross-entropy under TP."""

    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (CUDA + torch.compile only)."""

    pipeline_parallel_degree: int = 1
    """Ranks the model's layers are split over (pipeline parallelism)."""

    pipeline_parallel_schedule: str = "1F1B"
    """Schedule from ``torch.distributed.pipelining``: GPipe, 1F1B (one stage per rank),
    Interleaved1F1B, LoopedBFS, InterleavedZeroBubble (several stages per rank), ZBVZeroBubble,
    DualPipeV (two stages per rank in a V)."""

    pipeline_parallel_schedule_csv: str | None = None
    """A schedule written by hand, in torch's compute-only CSV format: one row per pipeline
    rank, one action per cell, ``<stage>F<micro-batch>`` forward, ``B`` full backward, ``I`` /
    ``W`` input / weight backward (e.g. ``0F0,0F1,2F0,...``). Each rank holds the stages its
    row names. Overrides ``pipeline_parallel_schedule``."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer blocks per stage (embeddings and output not counted); for the multi-stage
    schedules this also sets the stages per rank. ``None``: an even split, counting the
    embeddings and the output as one block each, 2 stages per rank for multi-stage schedules."""

    module_fqns_per_model_part: list[str] = field(default_factory=list)
    """Explicit split: one comma-separated list of module names per stage, in model order,
    e.g. ``"tok_embeddings,layers.0" "layers.1,norm,output"``. Overrides the even split."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch (a split of one accumulation batch inside the
    pipeline schedule)."""

    context_parallel_degree: int = 1
    """Ranks that split each sequence (CP): attention runs as ring attention over them, every
    other layer on the local share of the tokens. ``--training.seq_len`` must be divisible by
    2 x cp (cp without load balancing)."""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How key/value shards travel around the CP ring: ``allgather`` gathers them once (one
    collective, the whole sequence's K/V held at once), ``alltoall`` passes them on shard by
    shard (cp - 1 exchanges, one shard held at a time)."""

    context_parallel_load_balance: bool = True
    """Give every CP rank the same causal attention work: the sequence is cut into 2 x cp
    chunks and rank i takes chunks i and 2cp-1-i. Off: rank i takes the i-th contiguous
    piece (the last rank then does most of the attention work)."""

    expert_parallel_degree: int = 1
    """Ranks that split each MoE layer's routed experts (``num_experts / ep`` each), borrowed
    from dp_shard x cp x tp: with TP from the TP ranks first (then a multiple of the TP
    degree), then from the CP and dp_shard ranks (``docs/moe.md``)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "memory_budget"] = "none"
    """Recompute activations in backward to save memory: every block (``full``), some
    (``selective``), or what the compiler's partitioner chooses to fit ``memory_budget``
    (``memory_budget``: compiled blocks only, ``--compile.enable``)."""

    memory_budget: float = 0.5
    """For ``memory_budget``: the share of the activations the compiled blocks keep, between
    what full checkpointing of each compiled region keeps (0) and what they keep without
    checkpointing (1); the partitioner recomputes the cheapest ops first."""

    selective_ac_option: str = "2"
    """``op`` (save expensive ops) or N (checkpoint every N-th block) for ``selective``."""

    preserve_rng_state: bool = False
    """Replay the RNG state during recomputation (needed with dropout)."""

    determinism_check: str = "default"
    """Check that recomputed tensors match (``default``) or not (``none``)."""

    debug: bool = False
    """Log recomputed ops for debugging."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (and the loss)."""

    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What to compile."""

    backend: str = "inductor"
    """torch.compile backend."""


@dataclass
class Float8:
    enable: bool = False
    """Train linear layers in float8 via torchao (``pip install torchao``; ``make setup``
    installs it): real ``_scaled_mm`` on CPU (slower than bf16 there) and on CUDA 8.9+."""

    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao float8 scaling recipe: one scale per tensor, per row, or per row with the
    weight gradient in high precision."""

    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP parameters in float8 (``tensorwise``): a quarter of float32's bytes,
    half of bf16's. Works on NCCL and gloo (FSDP sends a unit whose inputs mix dtypes as
    bytes)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = True
    """With the float8 all-gather: compute every float8 weight's scale after the optimizer
    step in one all-reduce, instead of one all-reduce per weight inside each all-gather."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router.gate"])
    """Linear layers whose name contains one of these stay in high precision (so do layers
    whose dims are not multiples of 16). The default keeps the output projection and MoE
    routers (their logits pick each token's experts; 128 or 256 experts pass the alignment
    rule)."""

    emulate: bool = False
    """Emulate float8 matmuls in high precision (a GPU below compute capability 8.9)."""


@dataclass
class SemiSync:
    """Semi-synchronous data parallelism: the replicas of
    ``--parallelism.data_parallel_replicate_degree`` train apart (each reducing gradients only
    among its own ranks: FSDP, TP, CP, PP inside a replica as usual) and meet every
    ``sync_steps`` steps, so the links between replicas carry one exchange of the weights per
    ``sync_steps`` steps instead of every step's gradients."""

    method: Literal["none", "local_sgd", "diloco"] = "none"
    """``local_sgd``: every ``sync_steps`` steps the replicas' weights are averaged. ``diloco``
    (DiLoCo, Douillard et al. 2023): the replicas' mean change since the last sync (the
    pseudo-gradient) is applied to the weights of the last sync by an outer SGD with Nesterov
    momentum. ``none``: replicas reduce gradients every step (HSDP, DDP)."""

    sync_steps: int = 20
    """Optimizer steps between two syncs of each replica's weights (DiLoCo's H)."""

    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the paper's 0.7)."""

    outer_momentum: float = 0.9
    """DiLoCo's outer momentum (0: plain outer SGD)."""

    outer_nesterov: bool = True
    """Nesterov momentum for DiLoCo's outer step (the paper's choice)."""

    num_fragments: int = 1
    """Streaming DiLoCo (Douillard et al. 2025): the model's blocks are split into this many
    fragments of consecutive blocks (the embedding with the first, the final norm and output
    with the last), each synced every ``sync_steps`` steps at its own offset, so each exchange
    carries a fragment of the weights; must divide ``sync_steps``."""

    fragment_update_alpha: float = 0.0
    """After a sync each replica keeps ``alpha x`` its own weights plus ``(1 - alpha) x`` the
    synced ones (0: the synced weights, so every replica holds the same weights)."""

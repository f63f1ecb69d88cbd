"""The pre-flight rules of single features (checkpointing, float8, LoRA, data formats,
validation, activation checkpointing, compile, anomaly detection, and what
``COMM_MODE=local_tensor`` or DTensor-parametrized FSDP cannot run): each function returns
``(ok, message)`` pairs that ``config/validation.py`` checks in its one pass. No torch.
"""

from torchtitan.config.errors import did_you_mean
from torchtitan.config.job_config import JobConfig

CHECKPOINT_STATES = (
    "model", "optimizer", "lr_scheduler", "dataloader", "train_state", "spikes", "semi_sync",
)  # fmt: skip
"""What a checkpoint holds (``--checkpoint.exclude_from_loading`` names some of them)."""


def checkpoint_checks(config: JobConfig) -> list[tuple[bool, str]]:
    c = config.checkpoint
    unknown = [name for name in c.exclude_from_loading if name not in CHECKPOINT_STATES]
    hint = did_you_mean(unknown[0], CHECKPOINT_STATES) if unknown else ""
    return [
        (c.interval >= 1, f"--checkpoint.interval={c.interval} must be >= 1 (steps between saves)"),
        (c.keep_latest_k >= 0, f"--checkpoint.keep_latest_k={c.keep_latest_k} must be >= 0"),
        (c.keep_every >= 0, f"--checkpoint.keep_every={c.keep_every} must be >= 0 (0: none)"),
        (
            c.keep_every % c.interval == 0 if c.interval >= 1 else True,
            f"--checkpoint.keep_every={c.keep_every} must be a multiple of --checkpoint.interval="
            f"{c.interval}, or no checkpoint is saved at the steps it keeps",
        ),
        (
            c.initial_load_model_only or c.initial_load_path is not None,
            "--checkpoint.no_initial_load_model_only needs --checkpoint.initial_load_path: the "
            "step-N folder of the run to fork",
        ),
        (
            c.initial_load_model_only or config.lora.rank <= 0,
            "--checkpoint.no_initial_load_model_only with --lora.rank: LoRA reads its frozen "
            "weights from --checkpoint.initial_load_path; resume a LoRA run from its own folder",
        ),
        (
            not unknown,
            f"--checkpoint.exclude_from_loading {' '.join(unknown)}: not a checkpoint part"
            f"{hint}; choose from {', '.join(CHECKPOINT_STATES)}",
        ),
    ]


def float8_checks(config: JobConfig) -> list[tuple[bool, str]]:
    f = config.float8
    return [
        (
            not f.enable_fsdp_float8_all_gather or f.recipe_name == "tensorwise",
            f"--float8.enable_fsdp_float8_all_gather with --float8.recipe_name "
            f"{f.recipe_name}: torchao gathers float8 weights for tensorwise scaling only",
        ),
        (
            f.enable or not f.enable_fsdp_float8_all_gather,
            "--float8.enable_fsdp_float8_all_gather does nothing without --float8.enable; add it",
        ),
    ]


def lora_checks(config: JobConfig) -> list[tuple[bool, str]]:
    lo = config.lora
    return [
        (lo.rank >= 0, f"--lora.rank={lo.rank} must be >= 0 (0 turns LoRA off)"),
        (lo.rank == 0 or lo.alpha > 0, f"--lora.alpha={lo.alpha} must be > 0"),
        (
            lo.rank > 0 or not lo.target_modules,
            "--lora.target_modules does nothing without --lora.rank; add e.g. --lora.rank 8",
        ),
        (
            lo.rank > 0 or lo.alpha == type(lo)().alpha,
            f"--lora.alpha {lo.alpha} does nothing without --lora.rank (without it every weight "
            "trains); add e.g. --lora.rank 8",
        ),
        (
            all(not t.startswith(".") and not t.endswith(".") for t in lo.targets()),
            f"--lora.target_modules {' '.join(lo.target_modules)}: each entry is a module name "
            "or a dotted name suffix, like wq or attention.wo",
        ),
        (
            not lo.save_adapters_only
            or (lo.rank > 0 and config.checkpoint.enable and config.checkpoint.initial_load_path),
            "--lora.save_adapters_only needs --lora.rank, --checkpoint.enable and "
            "--checkpoint.initial_load_path (where every resume reads the frozen weights)",
        ),
    ]


def data_format_checks(config: JobConfig) -> list[tuple[bool, str]]:
    t, v = config.training, config.validation
    tokens = (
        [
            f"--training.dataset_mix {e}"
            for e in t.dataset_mix
            if e.startswith(("tokens=", "tokens:"))
        ]
        if t.dataset_mix
        else ["--training.dataset tokens"] * (t.dataset == "tokens")
    ) + ["--validation.dataset tokens"] * (v.enable and v.dataset == "tokens")
    return [
        (
            t.data_format == "text" or not tokens,
            f"{tokens[0] if tokens else ''}: pre-tokenized windows have no samples or roles, "
            f"and --training.data_format {t.data_format} reads them from rows; point it at the "
            "samples' json (files) or pass --training.data_format text",
        ),
        (
            t.chat_template is None or t.data_format == "chat",
            f"--training.chat_template does nothing with --training.data_format "
            f"{t.data_format}; add --training.data_format chat",
        ),
        (
            not t.train_on_prompt or t.data_format != "text",
            "--training.train_on_prompt does nothing with --training.data_format text (every "
            "token trains); it is for chat and prompt_completion",
        ),
        (t.packing_bins >= 1, f"--training.packing_bins={t.packing_bins} must be >= 1"),
        (
            t.shuffle_seed is None or t.shuffle_seed >= 0,
            f"--training.shuffle_seed={t.shuffle_seed} must be >= 0",
        ),
        (
            t.packing_bins == 1
            or (t.data_format != "text" and config.model.attn_mask == "block_causal"),
            f"--training.packing_bins {t.packing_bins} does nothing: it packs fine-tuning "
            "samples (--training.data_format chat or prompt_completion) under "
            "--model.attn_mask block_causal",
        ),
        (
            not (t.dataset_mix and t.dataset_path),
            "--training.dataset_path does nothing with --training.dataset_mix (each entry "
            "names its own: NAME=PATH:WEIGHT); drop one",
        ),
    ]


def validation_checks(config: JobConfig) -> list[tuple[bool, str]]:
    """Validation batches the training layout can run (-1: the training's)."""
    v, t, p = config.validation, config.training, config.parallelism
    batch = t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size
    seq = t.seq_len if v.seq_len == -1 else v.seq_len
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    chunks = (2 * cp if p.context_parallel_load_balance else cp) if cp > 1 else 1
    sequence_split = tp if tp > 1 and p.enable_sequence_parallel else 1
    pipelined = p.pipeline_parallel_degree > 1
    return [
        (v.freq >= 1, f"--validation.freq={v.freq} must be >= 1 (steps between validations)"),
        (v.steps == -1 or v.steps >= 1, f"--validation.steps={v.steps} must be -1 (all) or >= 1"),
        (batch >= 1, f"--validation.local_batch_size={batch} must be >= 1 (or -1)"),
        (
            1 <= seq <= t.seq_len,
            f"--validation.seq_len={seq} must be in [1, --training.seq_len={t.seq_len}] (the "
            "model's RoPE table is sized for the training length)",
        ),
        (
            seq % chunks == 0 and (seq // cp) % sequence_split == 0,
            f"--validation.seq_len={seq} must split over context parallelism ({chunks} chunks) "
            f"and then over the {sequence_split} sequence-parallel ranks; use a multiple of "
            f"{chunks * sequence_split}",
        ),
        (
            not pipelined or (batch, seq) == (t.local_batch_size, t.seq_len),
            f"--validation.local_batch_size={batch} and --validation.seq_len={seq} must equal "
            f"the training's ({t.local_batch_size}, {t.seq_len}) under pipeline parallelism "
            "(the schedule's micro-batches are fixed); leave them at -1",
        ),
    ]


def validation_only_checks(config: JobConfig) -> list[tuple[bool, str]]:
    """``--validation.only``: a validation to run, and no other kind of run asked for."""
    return [
        (
            config.validation.enable,
            "--validation.only runs one validation: add --validation.enable (and its dataset "
            "flags if not the default)",
        ),
        (
            not config.checkpoint.create_seed_checkpoint,
            "--validation.only and --checkpoint.create_seed_checkpoint are two different runs: "
            "choose one",
        ),
        (
            config.comm.mode != "fake_backend",
            "--validation.only under COMM_MODE=fake_backend: a dry run computes no values to "
            "validate; drop one (COMM_MODE=local_tensor computes them)",
        ),
    ]


def activation_checkpoint_checks(config: JobConfig) -> list[tuple[bool, str]]:
    ac = config.activation_checkpoint
    option = ac.selective_ac_option
    valid = option == "op" or (option.isdigit() and int(option) >= 1)
    compiled_blocks = config.compile.enable and "model" in config.compile.components
    return [
        (
            valid,
            f"--activation_checkpoint.selective_ac_option={option!r} must be 'op' or a "
            "positive integer N (checkpoint every N-th block)",
        ),
        (
            0 <= ac.memory_budget <= 1,
            f"--activation_checkpoint.memory_budget={ac.memory_budget} must be between 0 "
            "(recompute the most) and 1 (recompute nothing)",
        ),
        (
            ac.mode != "memory_budget" or compiled_blocks,
            "--activation_checkpoint.mode memory_budget lets torch.compile's partitioner choose "
            "what to recompute: add --compile.enable (with model in --compile.components)",
        ),
        (
            ac.mode != "memory_budget" or config.compile.backend in MIN_CUT_BACKENDS,
            f"--activation_checkpoint.mode memory_budget with --compile.backend "
            f"{config.compile.backend}: that backend splits forward and backward without the "
            f"budget (or not at all); use {', '.join(MIN_CUT_BACKENDS)}",
        ),
    ]


MIN_CUT_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition")
"""torch.compile backends whose partitioner (min-cut) reads the activation memory budget."""


def compile_checks(config: JobConfig) -> list[tuple[bool, str]]:
    p, c = config.parallelism, config.compile
    compiled_blocks = c.enable and "model" in c.components
    ac = config.activation_checkpoint
    whole_blocks = ac.mode == "full" or (ac.mode == "selective" and ac.selective_ac_option != "op")
    checkpointing = f"--activation_checkpoint.mode {ac.mode}"
    if ac.mode == "selective":
        checkpointing += f" --activation_checkpoint.selective_ac_option {ac.selective_ac_option}"
    return [
        (
            not (compiled_blocks and p.tensor_parallel_degree > 1 and whole_blocks),
            f"{checkpointing} (whole blocks) with --compile.enable and "
            "--parallelism.tensor_parallel_degree > 1 fails on torch 2.13; use "
            "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option "
            "op (per op), or drop --compile.enable",
        ),
        (
            not p.enable_async_tensor_parallel
            or (compiled_blocks and p.tensor_parallel_degree > 1),
            "--parallelism.enable_async_tensor_parallel needs --parallelism.tensor_parallel_degree"
            " > 1 and --compile.enable (inductor performs the overlap): add both or remove it",
        ),
    ]


def anomaly_checks(config: JobConfig) -> list[tuple[bool, str]]:
    """``--debug.detect_anomaly`` stops at the first non-finite value, checking it eagerly."""
    d = config.debug
    if config.comm.mode == "fake_backend":  # a dry run ignores the flag (with a warning)
        return []
    return [
        (
            not (d.detect_anomaly and config.compile.enable),
            "--debug.detect_anomaly checks each module's output eagerly, which a compiled block "
            "does not expose; drop --compile.enable for the rerun",
        ),
        (
            not (d.detect_anomaly and d.skip_nonfinite_steps),
            "--debug.detect_anomaly stops at the first non-finite value and "
            "--debug.skip_nonfinite_steps steps past it: choose one",
        ),
    ]


def semi_sync_checks(config: JobConfig) -> list[tuple[bool, str]]:
    """``--semi_sync``: replicas to train apart, and an outer step that can be taken."""
    s, p = config.semi_sync, config.parallelism
    if s.method == "none":
        return []
    flag = f"--semi_sync.method {s.method}"
    return [
        (
            p.data_parallel_replicate_degree >= 2,
            f"{flag} trains the replicas of --parallelism.data_parallel_replicate_degree apart: "
            f"it is {p.data_parallel_replicate_degree}; set it to 2 or more (each replica "
            "shards over --parallelism.data_parallel_shard_degree)",
        ),
        (s.sync_steps >= 1, f"--semi_sync.sync_steps={s.sync_steps} must be >= 1"),
        (
            s.num_fragments >= 1 and s.sync_steps % max(s.num_fragments, 1) == 0,
            f"--semi_sync.num_fragments={s.num_fragments} must be >= 1 and divide "
            f"--semi_sync.sync_steps={s.sync_steps} (each fragment syncs at its own offset)",
        ),
        (
            s.num_fragments == 1 or s.method == "diloco",
            f"--semi_sync.num_fragments={s.num_fragments} is streaming DiLoCo's: use it with "
            "--semi_sync.method diloco",
        ),
        (
            s.outer_lr > 0 and 0 <= s.outer_momentum < 1,
            f"--semi_sync.outer_lr={s.outer_lr} must be > 0 and --semi_sync.outer_momentum="
            f"{s.outer_momentum} in [0, 1)",
        ),
        (
            0 <= s.fragment_update_alpha < 1,
            f"--semi_sync.fragment_update_alpha={s.fragment_update_alpha} must be in [0, 1) "
            "(1 would never take the synced weights)",
        ),
        (
            not config.checkpoint.last_save_in_hf,
            f"--checkpoint.last_save_in_hf with {flag}: the export would hold rank 0's "
            "replica's own weights, not the synced model; convert the last checkpoint instead "
            "(python scripts/convert_hf.py to_hf: its model is the synced weights)",
        ),
        (
            config.comm.mode != "local_tensor" and fsdp_impl(config) != "simple",
            f"{flag} needs FSDP2 and real ranks: DTensor-parametrized FSDP "
            "(--parallelism.fsdp_impl simple, COMM_MODE=local_tensor's) shards over the replicas "
            "too; use --parallelism.fsdp_impl fsdp2 on real ranks",
        ),
    ]


def local_tensor_checks(config: JobConfig) -> list[tuple[bool, str]]:
    """What cannot run with every rank simulated in one process (``COMM_MODE=local_tensor``),
    then what DTensor-parametrized sharding (``fsdp_impl simple``) cannot do anywhere."""
    p = config.parallelism
    checks = []
    if config.comm.mode == "local_tensor":
        why = "cannot run under COMM_MODE=local_tensor"
        checks = [
            (
                p.fsdp_impl != "fsdp2",
                f"--parallelism.fsdp_impl fsdp2 {why} (FSDP2 frees parameter storage with "
                "resize_, which LocalTensor lacks); use auto or simple",
            ),
            (not config.compile.enable, f"--compile.enable {why}; drop the flag"),
            (
                config.checkpoint.initial_load_model_only,
                f"--checkpoint.no_initial_load_model_only {why} (it reads model weights only); "
                "drop it to start from that step's weights at step 0",
            ),
            (
                config.training.num_workers == 0,
                f"--training.num_workers {config.training.num_workers} {why} (the simulated "
                "ranks' batches cannot cross from worker processes); use 0",
            ),
            (
                not config.checkpoint.create_seed_checkpoint,
                f"--checkpoint.create_seed_checkpoint {why}: write it with NGPU=1 and no "
                "COMM_MODE; the simulation then loads it with --checkpoint.enable",
            ),
            (
                not config.training.enable_cpu_offload,
                f"--training.enable_cpu_offload {why}; drop the flag",
            ),
            (
                not (
                    p.pipeline_parallel_degree > 1
                    and (
                        config.profiling.enable_profiling or config.profiling.enable_memory_snapshot
                    )
                ),
                "--profiling.enable_profiling / enable_memory_snapshot with "
                f"--parallelism.pipeline_parallel_degree > 1 {why} (the simulated pipeline ranks "
                "are threads and torch's profiler is one per process); profile real ranks",
            ),
            (
                config.checkpoint.async_mode == "disabled",
                f"--checkpoint.async_mode {config.checkpoint.async_mode} {why} (the simulation "
                "only reads checkpoints); drop the flag",
            ),
            (
                not config.optimizer.stochastic_rounding,
                f"--optimizer.stochastic_rounding {why} (each simulated rank would need its own "
                "random bits); drop the flag or run real ranks",
            ),
            (
                not config.validation.sample_prompt,
                f"--validation.sample_prompt {why} (sampling reads each token on the host, "
                "which simulated ranks hold apart); sample from the checkpoint of a real run "
                "(python -m torchtitan.generate)",
            ),
        ]
    simple = fsdp_impl(config) == "simple"
    return checks + [
        (
            not (simple and config.training.enable_cpu_offload),
            "--training.enable_cpu_offload needs --parallelism.fsdp_impl fsdp2",
        ),
        (
            not (simple and p.fsdp_reshard_after_forward == "always"),
            "--parallelism.fsdp_reshard_after_forward always needs --parallelism.fsdp_impl "
            "fsdp2 (simple keeps gathered parameters until backward)",
        ),
        (
            p.fsdp_prefetch >= 0,
            f"--parallelism.fsdp_prefetch={p.fsdp_prefetch} must be >= 0 (blocks gathered "
            "ahead; 0 keeps FSDP2's own order)",
        ),
        (
            not (simple and p.fsdp_prefetch > 0),
            "--parallelism.fsdp_prefetch needs --parallelism.fsdp_impl fsdp2 (simple gathers "
            "each parameter when a module reads it)",
        ),
        (
            not (simple and config.float8.enable_fsdp_float8_all_gather),
            "--float8.enable_fsdp_float8_all_gather needs --parallelism.fsdp_impl fsdp2 (simple "
            "FSDP, which COMM_MODE=local_tensor uses, gathers in high precision)",
        ),
    ]


def fsdp_impl(config: JobConfig) -> str:
    impl = config.parallelism.fsdp_impl
    if impl != "auto":
        return impl
    return "simple" if config.comm.mode == "local_tensor" else "fsdp2"

"""One validation pass over a resolved ``JobConfig``: value ranges, cross-field rules, features
not built yet, degrees against the world size and the model, and what a comm mode cannot run.
Imports no torch: ``run_train.sh`` and the Slurm script run it (``python -m
torchtitan.config.manager --check``) before any rank starts, and every rank runs it again when
it parses its config. The few rules that need torch (the device) are in
:func:`validate_environment`, which the entry point runs before building anything.

A new technique adds its rules here, next to the ones of the techniques it composes with.
"""

import glob
import math
import os
from pathlib import Path

from torchtitan.config import sequence_rules
from torchtitan.config.errors import ConfigError, did_you_mean
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import pipeline_split
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.spec import ModelSpec, get_model_spec
from torchtitan.tools.paths import resolve_path

CHECKPOINT_STATES = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
"""What a checkpoint holds (``--checkpoint.exclude_from_loading`` names some of them)."""


def validate(config: JobConfig) -> None:
    """Check value ranges and cross-field rules; raise ``ConfigError`` naming the flag."""
    t, o, s = config.training, config.optimizer, config.lr_scheduler
    checks = [
        (t.steps >= 1, f"--training.steps={t.steps} must be >= 1"),
        (t.local_batch_size >= 1, f"--training.local_batch_size={t.local_batch_size} must be >= 1"),
        (
            t.global_batch_size == -1 or t.global_batch_size >= 1,
            f"--training.global_batch_size={t.global_batch_size} must be -1 (auto) or >= 1",
        ),
        (t.seq_len >= 1, f"--training.seq_len={t.seq_len} must be >= 1"),
        (t.gc_freq >= 0, f"--training.gc_freq={t.gc_freq} must be >= 0"),
        (t.num_workers >= 0, f"--training.num_workers={t.num_workers} must be >= 0"),
        (t.loss_chunks >= 1, f"--training.loss_chunks={t.loss_chunks} must be >= 1"),
        (0 < o.lr < math.inf, f"--optimizer.lr={o.lr} must be > 0 and finite"),
        (
            math.isfinite(t.max_norm),
            f"--training.max_norm={t.max_norm} must be finite (<= 0 turns clipping off)",
        ),
        (0 <= o.beta1 < 1, f"--optimizer.beta1={o.beta1} must be in [0, 1)"),
        (
            0 <= o.muon_momentum < 1,
            f"--optimizer.muon_momentum={o.muon_momentum} must be in [0, 1)",
        ),
        (o.muon_ns_steps >= 1, f"--optimizer.muon_ns_steps={o.muon_ns_steps} must be >= 1"),
        (
            not (o.name == "Muon" and t.enable_cpu_offload),
            "--optimizer.name Muon orthogonalises each matrix on the device, and "
            "--training.enable_cpu_offload keeps the parameters on the host; drop one",
        ),
        (0 <= o.beta2 < 1, f"--optimizer.beta2={o.beta2} must be in [0, 1)"),
        (0 < o.eps < math.inf, f"--optimizer.eps={o.eps} must be > 0 and finite"),
        (
            0 <= o.weight_decay < math.inf,
            f"--optimizer.weight_decay={o.weight_decay} must be >= 0 and finite",
        ),
        (s.warmup_steps >= 0, f"--lr_scheduler.warmup_steps={s.warmup_steps} must be >= 0"),
        (
            s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
            f"--lr_scheduler.decay_ratio={s.decay_ratio} must be in [0, 1]",
        ),
        (
            0 <= s.min_lr_factor <= 1,
            f"--lr_scheduler.min_lr_factor={s.min_lr_factor} must be in [0, 1]",
        ),
        (
            config.metrics.log_freq >= 1,
            f"--metrics.log_freq={config.metrics.log_freq} must be >= 1",
        ),
        (
            config.comm.init_timeout_seconds > 0,
            f"--comm.init_timeout_seconds={config.comm.init_timeout_seconds} must be > 0",
        ),
        (
            config.comm.train_timeout_seconds > 0,
            f"--comm.train_timeout_seconds={config.comm.train_timeout_seconds} must be > 0",
        ),
        (
            config.profiling.profile_freq
            >= config.profiling.profiler_warmup + config.profiling.profiler_active
            and config.profiling.profiler_active >= 1,
            f"--profiling.profile_freq={config.profiling.profile_freq} must be >= "
            f"profiler_warmup + profiler_active = {config.profiling.profiler_warmup} + "
            f"{config.profiling.profiler_active}, with profiler_active >= 1",
        ),
        (
            config.comm.dry_run_steps >= 0,
            f"--comm.dry_run_steps={config.comm.dry_run_steps} must be >= 0",
        ),
        (
            config.debug.device_memory_gib > 0,
            f"--debug.device_memory_gib={config.debug.device_memory_gib} must be > 0",
        ),
    ]
    p = config.parallelism
    for name in (
        "data_parallel_replicate_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
        "expert_parallel_degree",
    ):
        value = getattr(p, name)
        checks.append((value >= 1, f"--parallelism.{name}={value} must be >= 1"))
    dp_shard = p.data_parallel_shard_degree
    checks.append(
        (
            dp_shard == -1 or dp_shard >= 1,
            f"--parallelism.data_parallel_shard_degree={dp_shard} must be -1 (auto) or >= 1",
        )
    )
    c = config.checkpoint
    for flag, given in (
        ("--checkpoint.initial_load_path", c.initial_load_path is not None),
        ("--checkpoint.load_step", c.load_step != -1),
        ("--checkpoint.load_only", c.load_only),
        ("--checkpoint.last_save_in_hf", c.last_save_in_hf),
    ):
        checks.append(
            (not given or c.enable, f"{flag} does nothing without --checkpoint.enable; add it")
        )
    checks += _checkpoint_checks(config)
    checks += _path_checks(config)
    checks += _float8_checks(config)
    checks += _lora_checks(config)
    checks += _data_format_checks(config)
    checks += _activation_checkpoint_checks(config)
    checks += _compile_checks(config)
    checks += _local_tensor_checks(config)
    if config.validation.enable:
        checks += _validation_checks(config)
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    try:
        o.groups()
    except ValueError as e:
        raise ConfigError(f"--optimizer.param_groups {e}") from None
    try:
        t.mix()
    except ValueError as e:
        raise ConfigError(f"--training.dataset_mix {e}") from None

    spec = get_model_spec(config.model.name)
    if config.model.flavor not in spec.flavors:
        raise ConfigError(
            f"--model.flavor {config.model.flavor} is not a {config.model.name} flavor"
            f"{did_you_mean(config.model.flavor, spec.flavors)}; available: "
            f"{', '.join(spec.flavors)}"
        )
    if config.checkpoint.last_save_in_hf and spec.state_dict_adapter is None:
        raise ConfigError(
            f"--checkpoint.last_save_in_hf: model {spec.name} has no Hugging Face state-dict "
            "adapter yet; remove the flag"
        )
    if p.pipeline_parallel_degree > 1:
        sequence_rules.validate_pipeline(config, spec)
    if p.context_parallel_degree > 1:
        sequence_rules.validate_context_parallel(config, spec)
    if config.model.attn_mask == "block_causal" and "document_ids" not in spec.forward_keywords:
        raise ConfigError(
            f"--model.attn_mask block_causal: model {spec.name} does not take document_ids (its "
            "ModelSpec.forward_keywords); use --model.attn_mask causal"
        )

    world_size = os.environ.get("WORLD_SIZE")
    if world_size is not None:
        if not world_size.isdigit() or int(world_size) < 1:
            raise ConfigError(f"WORLD_SIZE={world_size!r} must be a positive integer (set NGPU)")
        validate_parallelism(config, spec, int(world_size))


def validate_environment(config: JobConfig, device_type: str) -> None:
    """The rules that depend on the machine (``device_type``: ``cuda`` or ``cpu``, found by the
    caller with torch). Every rank reaches the same verdict before it builds anything."""
    if config.parallelism.enable_async_tensor_parallel and device_type != "cuda":
        raise ConfigError(
            "--parallelism.enable_async_tensor_parallel needs CUDA (symmetric memory); "
            "remove it on CPU"
        )


def _checkpoint_checks(config: JobConfig) -> list[tuple[bool, str]]:
    c = config.checkpoint
    unknown = [name for name in c.exclude_from_loading if name not in CHECKPOINT_STATES]
    hint = did_you_mean(unknown[0], CHECKPOINT_STATES) if unknown else ""
    return [
        (c.interval >= 1, f"--checkpoint.interval={c.interval} must be >= 1 (steps between saves)"),
        (c.keep_latest_k >= 0, f"--checkpoint.keep_latest_k={c.keep_latest_k} must be >= 0"),
        (
            not unknown,
            f"--checkpoint.exclude_from_loading {' '.join(unknown)}: not a checkpoint part"
            f"{hint}; choose from {', '.join(CHECKPOINT_STATES)}",
        ),
    ]


def _path_checks(config: JobConfig) -> list[tuple[bool, str]]:
    """Folders the run writes into and files it reads, checked before anything starts (a
    folder that is a file would otherwise be found at the first save, after the training)."""
    dump = config.job.dump_folder
    checks = [
        (dump.strip() != "", "--job.dump_folder is empty; give a folder for logs and checkpoints")
    ]
    c = config.checkpoint
    folders = [("--job.dump_folder", Path(os.path.normpath(dump)))] if dump.strip() else []
    if dump.strip() and (c.enable or c.create_seed_checkpoint):
        folders.append(("--checkpoint.folder", Path(os.path.normpath(Path(dump) / c.folder))))
    for flag, folder in folders:
        blocker = next((p for p in (folder, *folder.parents) if _exists(p)), None)
        checks.append(
            (
                blocker is None or blocker.is_dir(),
                f"{flag}: {blocker} is a file, not a folder; choose another path",
            )
        )
    return checks


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a folder on the way that cannot be searched: found at write time
        return False


def validate_launch(config: JobConfig) -> None:
    """What a launch needs that printing or dry-running a config does not: the tokenizer file
    (a 405B config can be inspected, or dry-run on fake tensors, without one). The launchers'
    pre-flight (``python -m torchtitan.config.manager --check``) runs it for real runs."""
    if config.comm.mode == "fake_backend":
        return
    from torchtitan.components.tokenizer import find_tokenizer_file, missing_tokenizer_message

    tokenizer = resolve_path(config.model.tokenizer_path)
    if find_tokenizer_file(tokenizer) is None:
        raise ConfigError(missing_tokenizer_message(config.model.tokenizer_path, tokenizer))
    if config.training.data_format == "chat":
        from torchtitan.components.chat_template import find_template

        find_template(str(tokenizer), config.training.chat_template)
    datasets = [("--training.dataset_path", config.training.dataset_path)]
    if config.validation.enable:
        datasets.append(("--validation.dataset_path", config.validation.dataset_path))
    for flag, path in datasets:
        if path is not None and _local_path_missing(path):
            raise ConfigError(f"{flag} {path}: nothing there; give a file, glob or folder")


def _local_path_missing(path: str) -> bool:
    """A path that names a local place (absolute, ``./``, ``../``, ``~``) where nothing is;
    other values may be dataset ids on the Hugging Face hub."""
    if not path.startswith(("/", "./", "../", "~")):
        return False
    resolved = resolve_path(path)
    if any(c in path for c in "*?["):
        return not glob.glob(str(resolved), recursive=True)
    return not _exists(resolved)


def _float8_checks(config: JobConfig) -> list[tuple[bool, str]]:
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


def _lora_checks(config: JobConfig) -> list[tuple[bool, str]]:
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


def _data_format_checks(config: JobConfig) -> list[tuple[bool, str]]:
    t = config.training
    return [
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


def _validation_checks(config: JobConfig) -> list[tuple[bool, str]]:
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


def ignored_settings(config: JobConfig) -> list[str]:
    """Settings given a value that nothing reads in this run (their feature is off), and a
    warm-up longer than the run: one warning line each. Not refused: a TOML file may keep a
    feature's settings with the feature turned off."""
    defaults = JobConfig()
    notes = []
    for section, fields, switch, on in (
        ("checkpoint", ("interval", "async_mode"), "--checkpoint.enable", config.checkpoint.enable),
        ("float8", ("recipe_name",), "--float8.enable", config.float8.enable),
        (
            "validation",
            ("freq", "steps", "dataset"),
            "--validation.enable",
            config.validation.enable,
        ),
        (
            "activation_checkpoint",
            ("selective_ac_option",),
            "--activation_checkpoint.mode selective",
            config.activation_checkpoint.mode == "selective",
        ),
    ):
        given = getattr(config, section)
        for name in fields:
            value = getattr(given, name)
            if not on and value != getattr(getattr(defaults, section), name):
                notes.append(f"--{section}.{name} {value} is ignored without {switch}")
    warmup, steps = config.lr_scheduler.warmup_steps, config.training.steps
    if warmup > steps:
        notes.append(
            f"--lr_scheduler.warmup_steps {warmup} is longer than the run (--training.steps "
            f"{steps}): the LR never reaches --optimizer.lr {config.optimizer.lr}"
        )
    return notes


def _activation_checkpoint_checks(config: JobConfig) -> list[tuple[bool, str]]:
    ac = config.activation_checkpoint
    option = ac.selective_ac_option
    valid = option == "op" or (option.isdigit() and int(option) >= 1)
    return [
        (
            valid,
            f"--activation_checkpoint.selective_ac_option={option!r} must be 'op' or a "
            "positive integer N (checkpoint every N-th block)",
        )
    ]


def _compile_checks(config: JobConfig) -> list[tuple[bool, str]]:
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


def _local_tensor_checks(config: JobConfig) -> list[tuple[bool, str]]:
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
                not config.validation.sample_prompt,
                f"--validation.sample_prompt {why} (sampling reads each token on the host, "
                "which simulated ranks hold apart); sample from the checkpoint of a real run "
                "(python -m torchtitan.generate)",
            ),
        ]
    simple = _fsdp_impl(config) == "simple"
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


def validate_parallelism(config: JobConfig, spec: ModelSpec, world_size: int) -> ParallelDims:
    """Degrees against the world size (``ParallelDimsError``), the global batch against the
    data-parallel degree, then the degrees against the model's dims."""
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
    t = config.training
    parallel_dims.grad_accum_steps(t.local_batch_size, t.global_batch_size)
    if parallel_dims.ep > 1 and not spec.flavor_has_experts(config.model.flavor):
        what = f"flavor {config.model.flavor}" if spec.has_experts else f"model {spec.name}"
        raise ConfigError(
            f"--parallelism.expert_parallel_degree={parallel_dims.ep}: {what} has no experts; "
            "use 1, or a mixture-of-experts model (--module deepseek_v3, or --module qwen3 "
            "--config qwen3_moe_debugmodel, the small one; qwen3_30b_a3b at full size)"
        )
    if spec.validate is not None:
        spec.validate(config, parallel_dims)
    return parallel_dims


def resolve_auto(config: JobConfig) -> None:
    """Replace ``auto`` choices by what they mean for this run, so the resolved config (printed
    and saved) says what actually ran."""
    p = config.parallelism
    p.fsdp_impl = _fsdp_impl(config)
    v, t = config.validation, config.training
    v.local_batch_size = t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size
    v.seq_len = t.seq_len if v.seq_len == -1 else v.seq_len
    pp, csv_path = p.pipeline_parallel_degree, p.pipeline_parallel_schedule_csv
    if csv_path and pp > 1:
        split_backward = pipeline_split.read_csv_schedule(csv_path, pp)[2]
    else:
        split_backward = p.pipeline_parallel_schedule in pipeline_split.SPLIT_BACKWARD
    if pp > 1 and split_backward and p.fsdp_reshard_after_forward == "default":
        # Resharding after forward gives these schedules wrong gradients (torch 2.13).
        p.fsdp_reshard_after_forward = "never"


def _fsdp_impl(config: JobConfig) -> str:
    impl = config.parallelism.fsdp_impl
    if impl != "auto":
        return impl
    return "simple" if config.comm.mode == "local_tensor" else "fsdp2"

"""One validation pass over a resolved ``JobConfig``: value ranges, cross-field rules, features
not built yet, degrees against the world size and the model, and what a comm mode cannot run.
Imports no torch: ``run_train.sh`` and the Slurm script run it (``python -m
torchtitan.config.manager --check``) before any rank starts, and every rank runs it again when
it parses its config. The few rules that need torch (the device) are in
:func:`validate_environment`, which the entry point runs before building anything.

A new technique adds its rules next to the ones of the techniques it composes with: here for
value ranges and degrees, ``sequence_rules.py`` for PP and CP, ``feature_rules.py`` for a
single feature's flags.
"""

import glob
import math
import os
from pathlib import Path

from torchtitan.components import run_lock
from torchtitan.components.batch_schedule import (
    BatchSchedule,
    check_flags,
    ramp_end,
    sequences_through,
    stages_for,
    step_ranges,
)
from torchtitan.config import feature_rules, folders, sequence_rules
from torchtitan.config.errors import ConfigError, did_you_mean
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import pipeline_split
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.spec import ModelSpec, get_model_spec
from torchtitan.tools.paths import resolve_path


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
        (
            0 <= t.spike_sigma < math.inf,
            f"--training.spike_sigma={t.spike_sigma} must be >= 0 and finite (0: off)",
        ),
        (
            t.spike_window >= 2,
            f"--training.spike_window={t.spike_window} must be >= 2 (a spread needs two steps)",
        ),
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
        (
            not o.stochastic_rounding or t.dtype == "bfloat16",
            "--optimizer.stochastic_rounding rounds bf16 parameters, and this run's are "
            f"{t.dtype}; pass --training.dtype bfloat16 or drop it",
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
    checks += feature_rules.checkpoint_checks(config)
    checks += folders.path_checks(config)
    checks += feature_rules.float8_checks(config)
    checks += feature_rules.lora_checks(config)
    checks += feature_rules.data_format_checks(config)
    checks += feature_rules.activation_checkpoint_checks(config)
    checks += feature_rules.compile_checks(config)
    checks += feature_rules.anomaly_checks(config)
    checks += feature_rules.local_tensor_checks(config)
    checks += feature_rules.semi_sync_checks(config)
    if config.validation.enable:
        checks += feature_rules.validation_checks(config)
    if config.validation.only:
        checks += feature_rules.validation_only_checks(config)
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    check_flags(t)
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
    caller with torch), and the folders this node writes into. Every rank reaches the same
    verdict before it builds anything."""
    if config.parallelism.enable_async_tensor_parallel and device_type != "cuda":
        raise ConfigError(
            "--parallelism.enable_async_tensor_parallel needs CUDA (symmetric memory); "
            "remove it on CPU"
        )
    # Once per node (its ranks share its mounts), at the start, not at the first save.
    if config.comm.mode != "fake_backend" and os.environ.get("LOCAL_RANK", "0") == "0":
        folders.check_writable(config)


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
    t, v = config.training, config.validation
    datasets = [("--training.dataset_path", t.dataset_path, t.dataset)]
    if v.enable:
        datasets.append(("--validation.dataset_path", v.dataset_path, v.dataset))
    for flag, path, name in datasets:
        if name == "tokens":
            continue  # below
        if path is not None and _local_path_missing(path, files=name == "files"):
            where = "" if os.path.isabs(path) else f" (looked in {os.getcwd()} and the repository)"
            raise ConfigError(f"{flag} {path}: nothing there{where}; give a file, glob or folder")
    _check_token_folders(config, tokenizer)
    if not config.validation.only:
        for flag, folder in folders.locked_folders(config):
            run_lock.check_free(folder, flag=flag)
    folders.check_writable(config)  # last: a refused launch leaves no folder made


def _check_token_folders(config: JobConfig, tokenizer_path: Path) -> None:
    """Pre-tokenized data (``tokens``) named for training, in the mix or for validation: its
    folder complete, made with this run's tokenizer, at least one window long."""
    t, v = config.training, config.validation
    named = []  # (what names the folder, its path, the config section, its seq_len)
    if t.dataset == "tokens" and not t.dataset_mix:
        named.append((f"--training.dataset_path {t.dataset_path}", t.dataset_path, t))
    for entry in t.mix() if t.dataset_mix else ():
        if entry.name == "tokens":  # its path is given (``mix`` refuses one without)
            named.append((f"--training.dataset_mix {entry.written}", entry.path, t))
    if v.enable and v.dataset == "tokens":
        named.append((f"--validation.dataset_path {v.dataset_path}", v.dataset_path, v))
    if not named:
        return
    from torchtitan.components.token_shards import open_folder
    from torchtitan.components.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(tokenizer_path)
    world = os.environ.get("WORLD_SIZE", "1")
    dp = 1
    if world.isdigit():  # the launchers set it; a bad value was refused before this
        dp = ParallelDims.from_config(config.parallelism, int(world)).dp_degree
    seen: dict[str, str] = {}  # the training folders' contents (a mix's), by what named them
    for where, path, section in named:
        flag = "--training" if section is t else "--validation"
        if path is None:
            raise ConfigError(
                f"{flag}.dataset tokens needs {flag}.dataset_path: a folder that "
                "scripts/pretokenize.py wrote"
            )
        folder = open_folder(resolve_path(path), given=where)
        folder.check_tokenizer(tokenizer)
        windows = folder.tokens // (section.seq_len + 1)
        if windows < 1:
            raise ConfigError(
                f"{where}: its {folder.tokens:,} tokens are less than one window of "
                f"{flag}.seq_len {section.seq_len} + 1; use a shorter {flag}.seq_len or more data"
            )
        # Each data-parallel rank a block of the windows (by_row: all), each worker a share.
        by_row = t.data_sharding == "by_row"
        readers = (1 if by_row else dp) * max(1, t.num_workers)
        if windows < readers:
            who = (
                "--training.num_workers"
                if by_row
                else "data-parallel ranks x --training.num_workers"
            )
            raise ConfigError(
                f"{where}: its {folder.tokens:,} tokens make {windows} windows of "
                f"{flag}.seq_len {section.seq_len} + 1, fewer than the {readers} readers "
                f"({who}); use a shorter {flag}.seq_len, fewer readers or more data"
            )
        if section is t and folder.identity in seen:
            raise ConfigError(
                f"{where}: the same tokens as {seen[folder.identity]}; a mix names each folder "
                "once (they would read in the same order)"
            )
        if section is t:
            seen[folder.identity] = where


def _local_path_missing(path: str, *, files: bool) -> bool:
    """A path that names a local place where nothing is: any path of the ``files`` dataset,
    else one that looks local (absolute, ``./``, ``../``, ``~``); other values may be dataset
    ids on the Hugging Face hub."""
    if not files and not path.startswith(("/", "./", "../", "~")):
        return False
    resolved = resolve_path(path)
    if any(c in path for c in "*?["):
        return not glob.glob(str(resolved), recursive=True)
    return not folders.exists(resolved)


def ignored_settings(config: JobConfig, named: JobConfig | None = None) -> list[str]:
    """Settings given a value that nothing reads in this run (their feature is off), and a
    warm-up or batch ramp longer than the run, or skipped steps past it: one warning line
    each. Not refused: a TOML file may keep a feature's settings with the feature turned off.
    ``named``: the named config the run started from (``manager.named_config``), whose own
    values are not the user's to hear about (``llama3_debugmodel`` sets an interval for when
    checkpointing is turned on); default: the fields' defaults."""
    defaults = JobConfig() if named is None else named
    notes = []
    for section, fields, switch, on in (
        (
            "checkpoint",
            ("interval", "async_mode", "keep_every"),
            "--checkpoint.enable",
            config.checkpoint.enable,
        ),
        ("float8", ("recipe_name",), "--float8.enable", config.float8.enable),
        (
            "semi_sync",
            (
                "sync_steps",
                "outer_lr",
                "outer_momentum",
                "outer_nesterov",
                "num_fragments",
                "fragment_update_alpha",
            ),
            "--semi_sync.method",
            config.semi_sync.method != "none",
        ),  # fmt: skip
        ("training", ("spike_window",), "--training.spike_sigma", config.training.spike_sigma > 0),
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
        (
            "activation_checkpoint",
            ("memory_budget",),
            "--activation_checkpoint.mode memory_budget",
            config.activation_checkpoint.mode == "memory_budget",
        ),
    ):
        given = getattr(config, section)
        for name in fields:
            value = getattr(given, name)
            if not on and value != getattr(getattr(defaults, section), name):
                notes.append(f"--{section}.{name} {value} is ignored without {switch}")
    for flag, on in (
        ("--debug.detect_anomaly", config.debug.detect_anomaly),
        ("--training.spike_sigma", config.training.spike_sigma > 0),
    ):
        if on and config.comm.mode == "fake_backend":
            notes.append(
                f"{flag} is ignored under COMM_MODE=fake_backend: a dry run's values mean "
                "nothing (COMM_MODE=local_tensor computes them)"
            )
    t, warmup, steps = config.training, config.lr_scheduler.warmup_steps, config.training.steps
    length, said = steps, f"{steps}"
    if config.lr_scheduler.unit == "tokens" and t.global_batch_size != -1:  # full batches' worth
        length = sequences_through(stages_for(t, t.global_batch_size), steps) / t.global_batch_size
        said += f", the tokens of {length:.4g} full batches"
    if warmup > length - 1 and warmup > 0:  # the last step is still warming up
        notes.append(
            f"--lr_scheduler.warmup_steps {warmup} lasts the whole run (--training.steps "
            f"{said}): the LR never reaches --optimizer.lr {config.optimizer.lr}"
        )
    if t.spike_sigma > 0 and t.spike_window >= steps:
        notes.append(
            f"--training.spike_sigma {t.spike_sigma:g} judges no step: the first comes after "
            f"--training.spike_window {t.spike_window} steps, and --training.steps is {steps}"
        )
    full_at = ramp_end(t)
    if full_at is not None and full_at > steps:
        notes.append(
            f"--training.global_batch_size_ramp_sequences {t.global_batch_size_ramp_sequences} "
            f"lasts past the run: the batch reaches --training.global_batch_size at step "
            f"{full_at}, and --training.steps is {steps}"
        )
    past = [e for e in t.skip_steps if step_ranges([e])[0][0] > steps]
    if past:
        notes.append(
            f"--training.skip_steps {' '.join(past)}: past the run's last step (--training.steps "
            f"{steps})"
        )
    return notes


def validate_parallelism(config: JobConfig, spec: ModelSpec, world_size: int) -> ParallelDims:
    """Degrees against the world size (``ParallelDimsError``), the global batch against the
    data-parallel degree, then the degrees against the model's dims."""
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
    t = config.training
    BatchSchedule.from_config(t, parallel_dims)
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
    p.fsdp_impl = feature_rules.fsdp_impl(config)
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

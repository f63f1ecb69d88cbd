"""The pre-flight rules of the two techniques that cut a step along the model or the sequence:
pipeline parallelism (stages, schedules, micro-batches) and context parallelism (how sequences
split over the ranks). Part of the one validation pass (``config/validation.py`` calls them);
no torch.
"""

from torchtitan.config.errors import ConfigError, did_you_mean
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import pipeline_split
from torchtitan.models.spec import ModelSpec


def validate_pipeline(config: JobConfig, spec: ModelSpec) -> None:
    """A pipeline layout that the schedule and the model can run (``--parallelism.pipeline_*``)."""
    p, t = config.parallelism, config.training
    flag = "--parallelism.pipeline_parallel_schedule"
    schedule, pp = p.pipeline_parallel_schedule, p.pipeline_parallel_degree
    if schedule not in pipeline_split.SCHEDULES:
        same_letters = [s for s in pipeline_split.SCHEDULES if s.lower() == schedule.lower()]
        hint = f" (did you mean {same_letters[0]}?)" if same_letters else ""
        raise ConfigError(
            f"{flag} {schedule} is not a schedule"
            f"{hint or did_you_mean(schedule, pipeline_split.SCHEDULES)}; available: "
            f"{', '.join(pipeline_split.SCHEDULES)}"
        )
    if spec.pipeline is None:
        raise ConfigError(
            f"--parallelism.pipeline_parallel_degree {pp}: model {spec.name} has no pipeline "
            "split (ModelSpec.pipeline); train it without pipeline parallelism"
        )
    mbs = p.pipeline_parallel_microbatch_size
    if mbs < 1 or t.local_batch_size % mbs:
        raise ConfigError(
            f"--training.local_batch_size={t.local_batch_size} is not a multiple of "
            f"--parallelism.pipeline_parallel_microbatch_size={mbs}: each accumulation batch "
            "is cut into pipeline micro-batches of that size"
        )
    n_mb = t.local_batch_size // mbs
    args = spec.flavors[config.model.flavor]
    layout = pipeline_split.pipeline_layout(p, args.n_layers)
    num_stages = layout.num_stages
    if p.pipeline_parallel_layers_per_stage is not None and schedule in pipeline_split.SINGLE_STAGE:
        pipeline_split.split_blocks(
            args.n_layers, num_stages, layers_per_stage=p.pipeline_parallel_layers_per_stage
        )
    names = spec.pipeline(args, num_stages, p)
    blockless = [stage for stage in names if not any(n.startswith("layers.") for n in stage)]
    if config.lora.rank > 0 and not config.lora.targets() and blockless:
        raise ConfigError(
            f"--lora.rank with its default targets (the blocks' layers): the pipeline stage of "
            f"{', '.join(blockless[0])} holds no block, so nothing to train (its optimizer "
            "could not be stepped or saved); give every stage a block with "
            "--parallelism.pipeline_parallel_layers_per_stage or "
            "--parallelism.module_fqns_per_model_part, or target a layer it holds"
        )
    if len(names) != num_stages:
        raise ConfigError(
            f"--parallelism.module_fqns_per_model_part lists {len(names)} stages, but {schedule} "
            f"on {pp} pipeline ranks runs {num_stages}: give one list per stage"
        )
    if layout.csv_microbatches is not None:
        if layout.csv_microbatches != n_mb:
            raise ConfigError(
                f"--parallelism.pipeline_parallel_schedule_csv {p.pipeline_parallel_schedule_csv} "
                f"schedules {layout.csv_microbatches} micro-batches, this run has {n_mb} "
                f"(--training.local_batch_size {t.local_batch_size} / "
                f"--parallelism.pipeline_parallel_microbatch_size {mbs})"
            )
    else:
        needs = {"1F1B": num_stages, "DualPipeV": num_stages}.get(schedule, 1)
        rounds = max(1, n_mb // pp)
        if n_mb < needs or (schedule.startswith("Interleaved") and n_mb % rounds):
            raise ConfigError(
                f"{flag} {schedule} with {num_stages} stages cannot run {n_mb} micro-batches "
                f"(--training.local_batch_size {t.local_batch_size} / "
                f"--parallelism.pipeline_parallel_microbatch_size {mbs}): use at least {needs}"
                + (f" and a multiple of {rounds}" if schedule.startswith("Interleaved") else "")
            )
    split_backward = layout.split_backward
    if p.pipeline_parallel_schedule_csv:
        schedule = p.pipeline_parallel_schedule_csv
        flag = "--parallelism.pipeline_parallel_schedule_csv"
    ac = config.activation_checkpoint
    rules = [
        (
            not (split_backward and ac.mode == "selective" and ac.selective_ac_option == "op"),
            f"{flag} {schedule} splits backward into input and weight passes, which per-op "
            "selective activation checkpointing cannot replay; use --activation_checkpoint.mode "
            "full or selective with a block interval",
        ),
        (
            not (split_backward and config.compile.enable),
            f"{flag} {schedule} refuses compiled stage modules (torch 2.13); drop --compile.enable "
            "or use 1F1B / Interleaved1F1B",
        ),
        (
            not (split_backward and p.fsdp_reshard_after_forward == "always"),
            f"{flag} {schedule} with --parallelism.fsdp_reshard_after_forward always gives wrong "
            "gradients on torch 2.13; use default (never under this schedule) or never",
        ),
        (
            not t.enable_cpu_offload,
            "--parallelism.pipeline_parallel_degree with --training.enable_cpu_offload is not "
            "supported yet; drop one",
        ),
        (
            not (config.validation.enable and _neighbours_on_one_rank(layout.stages_by_rank)),
            f"--validation.enable with {flag} {schedule}: a rank holds two neighbouring stages "
            "(a V-shaped schedule), and torch's evaluation of such a schedule still runs the "
            "backward hand-off between them and fails (torch 2.13); validate under a looped "
            "schedule (1F1B, Interleaved1F1B, ...) or drop --validation.enable",
        ),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def _neighbours_on_one_rank(stages_by_rank: list[list[int]]) -> bool:
    return any(stage + 1 in stages for stages in stages_by_rank for stage in stages)


def validate_context_parallel(config: JobConfig, spec: ModelSpec) -> None:
    """Sequences the ``cp`` ranks can split, on a model that can be split."""
    p, t = config.parallelism, config.training
    cp = p.context_parallel_degree
    flag = f"--parallelism.context_parallel_degree={cp}"
    if "positions" not in spec.forward_keywords:
        raise ConfigError(
            f"{flag}: model {spec.name} does not support context parallelism (its "
            "ModelSpec.forward_keywords has no positions); use degree 1"
        )
    if config.model.attn_mask == "block_causal" and p.context_parallel_rotate_method != "allgather":
        raise ConfigError(
            f"--parallelism.context_parallel_rotate_method={p.context_parallel_rotate_method} "
            f"with --model.attn_mask block_causal: block-causal attention under context "
            f"parallelism gathers every rank's keys and values at once; pass "
            f"--parallelism.context_parallel_rotate_method allgather"
        )
    chunks = 2 * cp if p.context_parallel_load_balance else cp
    if t.seq_len % chunks:
        how = (
            f"2 x cp = {chunks} chunks (load balancing; --parallelism."
            "no_context_parallel_load_balance needs only cp)"
            if p.context_parallel_load_balance
            else f"{cp} pieces"
        )
        raise ConfigError(
            f"{flag}: --training.seq_len={t.seq_len} must split into {how}; pick a seq_len "
            f"that is a multiple of {chunks}"
        )

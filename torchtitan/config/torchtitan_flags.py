"""Flags of torchtitan 0.3.0 (and 0.2) that this project spells another way or does not need:
an unknown flag (or TOML field) that is one of them is answered with what to write here
instead of a spelling guess. No torch."""

_PIPELINE_SPLIT = (
    "not needed here: the default split weighs the embedding and output in blocks and "
    "balances each stage's cost; --parallelism.pipeline_parallel_layers_per_stage or "
    "--parallelism.module_fqns_per_model_part set it by hand (docs/pipeline.md)"
)

_PRINT_CONFIG = (
    "here: python -m torchtitan.config.manager --module M --config C [flags] prints the "
    "resolved config, and every run writes it to <dump_folder>/config.toml"
)

MIGRATED = {
    "checkpoint.initial_load_in_hf": (
        "not needed here: --checkpoint.initial_load_path takes a Hugging Face folder (found by "
        "its config.json and safetensors) as well as a step-N folder"
    ),
    "checkpoint.initial_load_in_hf_quantized": (
        "not needed here: fp8 block-quantized Hugging Face weights are found from the folder's "
        "config.json and loaded dequantized (docs/hf.md)"
    ),
    "debug.batch_invariant": (
        "not built here (batch-invariant kernels); --debug.seed with --debug.deterministic "
        "repeats a run bitwise in one layout, and docs/converging.md compares layouts"
    ),
    "debug.enable_structured_logging": (
        "not needed here: every run writes metrics.jsonl, events.jsonl and a log per rank in "
        "--job.dump_folder (docs/training.md)"
    ),
    "activation_checkpoint.visualize_memory_budget_pareto": (
        "not built here (the partitioner's runtime-memory plot); set "
        "--activation_checkpoint.memory_budget and compare the runs' memory and tokens/s"
    ),
    "debug.moe_force_load_balance": "here it is --moe.force_load_balance",
    "debug.print_config": _PRINT_CONFIG,
    "job.print_config": _PRINT_CONFIG,  # torchtitan 0.2's spelling
    "fault_tolerance.enable": (
        "not built here (torchft's replica groups that outlive a failed one); MAX_RESTARTS=N "
        "restarts every rank from the last checkpoint (docs/fault_tolerance.md), and "
        "--semi_sync.method trains replicas semi-synchronously"
    ),
    "fault_tolerance.semi_sync_method": (
        "here it is --semi_sync.method (diloco or local_sgd), over the replicas of "
        "--parallelism.data_parallel_replicate_degree in one job (docs/semi_sync.md)"
    ),
    "fault_tolerance.sync_steps": "here it is --semi_sync.sync_steps",
    "fault_tolerance.num_fragments": "here it is --semi_sync.num_fragments",
    "fault_tolerance.fragment_update_alpha": "here it is --semi_sync.fragment_update_alpha",
    "fault_tolerance.fragment_sync_delay": (
        "not built here: each fragment's exchange completes at its sync step "
        "(--semi_sync.num_fragments)"
    ),
    "metrics.disable_color_printing": "here it is --metrics.no_enable_color_printing",
    "parallelism.context_parallel_load_balancer": (
        "here it is --parallelism.context_parallel_load_balance, on by default (head-tail); "
        "--parallelism.no_context_parallel_load_balance turns it off"
    ),
    "parallelism.context_parallel_ptrr_mask_key": (
        "not needed here: context parallelism balances head-tail "
        "(--parallelism.context_parallel_load_balance); PTRR is not built"
    ),
    "parallelism.enable_fsdp_symm_mem": (
        "not built here (FSDP collectives in CUDA symmetric memory)"
    ),
    "parallelism.spmd_backend": (
        "not needed here: tensor, context and expert parallelism use DTensor, data parallelism "
        "FSDP2 or DTensor parametrizations (--parallelism.fsdp_impl simple)"
    ),
    "parallelism.expert_tensor_parallel_degree": (
        "not built here (each expert's matrices split over the tensor-parallel ranks as well; "
        "torchtitan has since dropped it): --parallelism.expert_parallel_degree spans the "
        "tensor-parallel ranks, each holding whole experts (docs/moe.md)"
    ),
    "parallelism.expert_parallel_comm_backend": (
        "not built here (DeepEP's dispatch kernels, CUDA only): experts exchange their tokens "
        "with torch's all-to-all (docs/moe.md)"
    ),
    "parallelism.pipeline_parallel_first_stage_less_layers": _PIPELINE_SPLIT,
    "parallelism.pipeline_parallel_last_stage_less_layers": _PIPELINE_SPLIT,
    "training.disable_cuda_graphs": (
        "not needed here: steps are captured in CUDA graphs only with --compile.backend cudagraphs"
    ),
}
"""``section.field`` of torchtitan 0.3.0 -> what to write here (or why nothing is needed)."""


def hint(name: str, *, off: bool = False) -> str:
    """`` (torchtitan 0.3.0's flag; ...)`` for one of its flags (``section.field``, without
    dashes, underscores as written there), else an empty string. ``off``: a boolean of theirs
    turned off (``--section.no_field``, ``field = false``), which is this project's default."""
    known = MIGRATED.get(name)
    if not known:
        return ""
    return (
        f" (torchtitan 0.3.0's flag; {'leave it out: off is the default here' if off else known})"
    )

"""Llama 3 (and 3.1/3.2 sizes). Importing this package does not import torch, so the config
pre-flight can list and validate configs quickly; the model and its plans load when a run
builds them."""

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.moe_args import check_moe_run
from torchtitan.models.llama3 import config_registry
from torchtitan.models.llama3.args import Llama3Args, check_parallel_degrees, flavors
from torchtitan.models.llama3.pipeline import pipeline_llama3
from torchtitan.models.spec import ModelSpec, lazy

__all__ = ["Llama3Args", "config_registry", "flavors", "model_spec"]


def validate(config, parallel_dims) -> None:
    """Model-specific checks of a config against its parallel degrees (no torch import)."""
    validate_args(flavors[config.model.flavor], config, parallel_dims)


def validate_args(args: Llama3Args, config, parallel_dims) -> None:
    """:func:`validate` for the flavor ``args`` (families built on Llama 3's model share it)."""
    if parallel_dims.pp > 1 and args.tie_word_embeddings:
        raise ConfigError(
            f"--model.flavor {config.model.flavor} ties the output to the embeddings, which "
            "pipeline parallelism puts on different stages; use "
            "--parallelism.pipeline_parallel_degree 1 or an untied flavor"
        )
    if args.moe is not None:
        check_moe_run(config, parallel_dims, config.model.name)
    rotate = config.parallelism.context_parallel_rotate_method
    if parallel_dims.cp > 1 and rotate != "allgather":
        gathers = {"sinks": args.attention_sinks, "sliding windows": args.sliding_window,
                   "chunks": args.attention_chunk}  # fmt: skip
        if why := [name for name, on in gathers.items() if on]:
            raise ConfigError(
                f"--parallelism.context_parallel_rotate_method {rotate} with --model.flavor "
                f"{config.model.flavor} of {config.model.name}: attention with "
                f"{' and '.join(why)} gathers the whole sequence's keys and values on every "
                "rank; use allgather"
            )
    check_parallel_degrees(
        args,
        flavor=config.model.flavor,
        tp=parallel_dims.tp,
        sequence_parallel=config.parallelism.enable_sequence_parallel,
        seq_len=config.training.seq_len,
        cp=parallel_dims.cp,
        ep=parallel_dims.ep,
    )


model_spec = ModelSpec(
    name="llama3",
    flavors=flavors,
    config_registry=config_registry,
    build_model=lazy("torchtitan.models.llama3.model:Transformer"),
    parallelize=lazy("torchtitan.models.llama3.parallelize:parallelize_llama3"),
    flops_per_token=Llama3Args.flops_per_token,
    validate=validate,
    pipeline=pipeline_llama3,
    forward_keywords=("positions", "document_ids"),
    state_dict_adapter=lazy("torchtitan.models.llama3.state_dict_adapter:Llama3StateDictAdapter"),
)

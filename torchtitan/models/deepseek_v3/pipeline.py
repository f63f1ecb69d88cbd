"""How DeepSeek-V3 is split into pipeline stages: module names per stage (a plan, no torch)."""

from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.pipeline_split import decoder_stages_by_name, split_blocks
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args


def pipeline_deepseek_v3(
    args: DeepSeekV3Args, num_stages: int, parallelism: Parallelism
) -> list[list[str]]:
    """Embeddings first, final norm and output last, the blocks in order between them
    (``--parallelism.pipeline_parallel_layers_per_stage``, a split balancing the matmul cost
    a token activates, or the explicit ``--parallelism.module_fqns_per_model_part``)."""
    if parallelism.module_fqns_per_model_part:
        return decoder_stages_by_name(parallelism.module_fqns_per_model_part, args.n_layers)
    # In units of the average block's activated weights (dense and MoE blocks differ little
    # per token; the split counts blocks).
    per_block = (args.num_params(activated=True) - args.vocab_size * args.dim) / args.n_layers
    return split_blocks(
        args.n_layers,
        num_stages,
        layers_per_stage=parallelism.pipeline_parallel_layers_per_stage,
        first=("tok_embeddings",),
        last=("norm", "output"),
        first_cost=0.0,
        last_cost=args.vocab_size * args.dim / per_block,
    )

"""How Llama 3 is split into pipeline stages: module names per stage. A plan only, no torch:
the config pre-flight checks it, ``torchtitan.distributed.pipeline_parallel`` cuts the model."""

from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.pipeline_split import decoder_stages_by_name, split_blocks
from torchtitan.models.llama3.args import Llama3Args


def pipeline_llama3(args: Llama3Args, num_stages: int, parallelism: Parallelism) -> list[list[str]]:
    """Embeddings on the first stage, final norm and output on the last, the blocks in order
    between them (``--parallelism.pipeline_parallel_layers_per_stage``, or a split that
    balances the matmul cost), or the explicit ``--parallelism.module_fqns_per_model_part``."""
    if parallelism.module_fqns_per_model_part:
        return decoder_stages_by_name(parallelism.module_fqns_per_model_part, args.n_layers)
    # Costs in blocks, from the matmul weights a token passes through (with experts, those it
    # activates): the embedding is a lookup; the output projection is vocab x dim (about 2.4
    # blocks for 8B, 0.7 for debug).
    q_dim, kv_dim = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    block = 2 * args.dim * q_dim + 2 * args.dim * kv_dim + args.ffn_params(activated=True)
    return split_blocks(
        args.n_layers,
        num_stages,
        layers_per_stage=parallelism.pipeline_parallel_layers_per_stage,
        first=("tok_embeddings",),
        last=("norm", "output"),
        first_cost=0.0,
        last_cost=args.vocab_size * args.dim / block,
    )

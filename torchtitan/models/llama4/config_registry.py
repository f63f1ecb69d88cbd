"""Named Llama 4 training configs: ``--module llama4 --config <function name>``."""

import dataclasses

from torchtitan.config.job_config import JobConfig, MoE
from torchtitan.models.common.presets import debug_run, pretraining_run

# Llama 4's tokenizer (a tokenizer.json of 202,048 ids), downloaded into
# assets/hf/Llama-4-Scout-17B-16E by
# `python scripts/download_hf_assets.py --repo_id meta-llama/Llama-4-Scout-17B-16E --assets tokenizer`.
TOKENIZER_REPO = "meta-llama/Llama-4-Scout-17B-16E"

# The published models have no routing bias (an export to Llama4ForCausalLM would route
# differently with one): balance with the sequence-wise loss instead.
LLAMA4_BALANCING = MoE(load_balance_coeff=0.0, aux_loss_coeff=1e-4)


def llama4_debugmodel() -> JobConfig:
    """4-layer, 256-wide Llama 4 (8 experts, top 1, a shared one, in every 2nd block; chunks of
    32 tokens, a block without RoPE) on the bundled corpus: trains in minutes on a CPU."""
    return dataclasses.replace(debug_run("llama4"), moe=LLAMA4_BALANCING)


def _pretraining(flavor: str, *, lr: float) -> JobConfig:
    config = pretraining_run(
        "llama4", flavor, tokenizer_path=f"assets/hf/{TOKENIZER_REPO.split('/')[1]}", lr=lr,
        local_batch_size=1, seq_len=8192, ac="full",
    )  # fmt: skip
    return dataclasses.replace(config, moe=LLAMA4_BALANCING)


def llama4_17bx16e() -> JobConfig:
    """Llama 4 Scout (16 experts, one per token, in every block); give it expert parallelism,
    e.g. ``--parallelism.expert_parallel_degree 8``."""
    return _pretraining("17bx16e", lr=4e-4)


def llama4_17bx128e() -> JobConfig:
    """Llama 4 Maverick (128 experts in every 2nd block), for many nodes with expert
    parallelism."""
    return _pretraining("17bx128e", lr=4e-4)

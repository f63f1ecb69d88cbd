"""Named Qwen3 training configs: ``--module qwen3 --config <function name>``."""

import dataclasses

from torchtitan.config.job_config import JobConfig, MoE
from torchtitan.models.common.presets import debug_run, pretraining_run
from torchtitan.models.qwen3.args import flavors

# Every Qwen3 size shares one tokenizer (a tokenizer.json without a bos token: documents are
# framed by <|endoftext|>), downloaded into assets/hf/Qwen3-0.6B-Base by
# `python scripts/download_hf_assets.py --repo_id Qwen/Qwen3-0.6B-Base --assets tokenizer`.
TOKENIZER_REPO = "Qwen/Qwen3-0.6B-Base"


def qwen3_debugmodel() -> JobConfig:
    """6-layer, 256-wide Qwen3 (8 heads of 64) on the bundled corpus: trains in minutes on a
    laptop CPU."""
    return debug_run("qwen3")


# Qwen3's MoE sizes balance their experts with a loss, not a routing bias (which their Hugging
# Face form has no place for: with these settings a run exports to Qwen3MoeForCausalLM
# exactly). Qwen's loss is Switch's over the whole batch, all layers pooled, weighted 0.001
# (router_aux_loss_coef); ours is DeepSeek-V3's sequence-wise loss per layer, whose gradient per
# router score is about coeff / tokens where Qwen's is 0.001 x top_k / (layers x tokens):
# 1.7e-4 for 30B-A3B, 8.5e-5 for 235B-A22B. 1e-4 is DeepSeek-V3's own weight for its loss.
QWEN3_MOE_BALANCING = MoE(load_balance_coeff=0.0, aux_loss_coeff=1e-4)


def qwen3_moe_debugmodel() -> JobConfig:
    """4-layer, 256-wide Qwen3 with 8 experts (top 2) in every block, on the bundled corpus."""
    return dataclasses.replace(debug_run("qwen3", flavor="debugmodel_moe"), moe=QWEN3_MOE_BALANCING)


def _pretraining(
    flavor: str, *, lr: float, local_batch_size: int, ac: str = "selective"
) -> JobConfig:
    """The full-size runs, 4096 tokens per sequence, with the Qwen3 tokenizer."""
    config = pretraining_run(
        "qwen3", flavor, tokenizer_path=f"assets/hf/{TOKENIZER_REPO.split('/')[1]}", lr=lr,
        local_batch_size=local_batch_size, seq_len=4096, ac=ac,
    )  # fmt: skip
    if flavors[flavor].moe is not None:  # the MoE sizes
        config = dataclasses.replace(config, moe=QWEN3_MOE_BALANCING)
    return config


def qwen3_0_6b() -> JobConfig:
    return _pretraining("0.6B", lr=3e-4, local_batch_size=4)


def qwen3_1_7b() -> JobConfig:
    return _pretraining("1.7B", lr=3e-4, local_batch_size=2)


def qwen3_4b() -> JobConfig:
    return _pretraining("4B", lr=3e-4, local_batch_size=2)


def qwen3_8b() -> JobConfig:
    return _pretraining("8B", lr=3e-4, local_batch_size=1)


def qwen3_14b() -> JobConfig:
    return _pretraining("14B", lr=2e-4, local_batch_size=1, ac="full")


def qwen3_32b() -> JobConfig:
    return _pretraining("32B", lr=1.5e-4, local_batch_size=1, ac="full")


def qwen3_30b_a3b() -> JobConfig:
    """Qwen3-30B-A3B (128 experts, 8 per token); give it expert parallelism, e.g.
    ``--parallelism.expert_parallel_degree 8``."""
    return _pretraining("30B-A3B", lr=3e-4, local_batch_size=1, ac="full")


def qwen3_235b_a22b() -> JobConfig:
    """Qwen3-235B-A22B (128 experts, 8 per token), for many nodes with expert parallelism."""
    return _pretraining("235B-A22B", lr=1.5e-4, local_batch_size=1, ac="full")

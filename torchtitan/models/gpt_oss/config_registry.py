"""Named gpt-oss training configs: ``--module gpt_oss --config <function name>``."""

import dataclasses

from torchtitan.config.job_config import JobConfig, MoE
from torchtitan.models.common.presets import debug_run, pretraining_run

# gpt-oss's tokenizer (o200k_harmony, 201,088 ids) as a tokenizer.json, downloaded into
# assets/hf/gpt-oss-20b by
# `python scripts/download_hf_assets.py --repo_id openai/gpt-oss-20b --assets tokenizer`.
TOKENIZER_REPO = "openai/gpt-oss-20b"

# The router's learned bias is part of the published model; the balancing bias of DeepSeek-V3
# is not (an export to GptOssForCausalLM would route differently): balance with the
# sequence-wise loss instead.
GPT_OSS_BALANCING = MoE(load_balance_coeff=0.0, aux_loss_coeff=1e-4)


def gpt_oss_debugmodel() -> JobConfig:
    """4-layer, 256-wide gpt-oss (8 experts, top 2, a 32-token window in every other block)
    on the bundled corpus: trains in minutes on a CPU."""
    return dataclasses.replace(debug_run("gpt_oss"), moe=GPT_OSS_BALANCING)


def _pretraining(flavor: str, *, lr: float) -> JobConfig:
    config = pretraining_run(
        "gpt_oss", flavor, tokenizer_path=f"assets/hf/{TOKENIZER_REPO.split('/')[1]}", lr=lr,
        local_batch_size=1, seq_len=4096, ac="full",
    )  # fmt: skip
    return dataclasses.replace(config, moe=GPT_OSS_BALANCING)


def gpt_oss_20b() -> JobConfig:
    """gpt-oss-20b (32 experts, 4 per token); give it expert parallelism, e.g.
    ``--parallelism.expert_parallel_degree 8``."""
    return _pretraining("20b", lr=3e-4)


def gpt_oss_120b() -> JobConfig:
    """gpt-oss-120b (128 experts, 4 per token), for several nodes with expert parallelism."""
    return _pretraining("120b", lr=1.5e-4)

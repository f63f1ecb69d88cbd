"""Named DeepSeek-V3 training configs: ``--module deepseek_v3 --config <function name>``."""

from torchtitan.config.job_config import JobConfig
from torchtitan.models.common.presets import debug_run, pretraining_run

# The hub repository whose tokenizer each flavor uses (its tokenizer.json), downloaded into
# assets/hf/<name> by `python scripts/download_hf_assets.py --repo_id <repo> --assets tokenizer`.
TOKENIZER_REPOS = {"16B": "deepseek-ai/DeepSeek-V2-Lite", "671B": "deepseek-ai/DeepSeek-V3"}


def deepseek_v3_debugmodel() -> JobConfig:
    """4 layers (1 dense, 3 with 8 experts, top-2, 1 shared), 256 wide, on the bundled corpus:
    trains in minutes on a laptop CPU."""
    return debug_run("deepseek_v3")


def _pretraining(flavor: str, *, lr: float, local_batch_size: int) -> JobConfig:
    """The full-size runs, 4096 tokens per sequence, every block checkpointed."""
    return pretraining_run(
        "deepseek_v3", flavor, tokenizer_path=f"assets/hf/{TOKENIZER_REPOS[flavor].split('/')[1]}",
        lr=lr, local_batch_size=local_batch_size, seq_len=4096, ac="full",
    )  # fmt: skip


def deepseek_v3_16b() -> JobConfig:
    return _pretraining("16B", lr=2.2e-4, local_batch_size=4)


def deepseek_v3_671b() -> JobConfig:
    return _pretraining("671B", lr=2.2e-4, local_batch_size=1)

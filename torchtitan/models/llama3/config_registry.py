"""Named Llama 3 training configs: ``--module llama3 --config <function name>``.

Each function returns a complete ``JobConfig``; TOML files and CLI flags layer on top.
Private helpers (leading underscore) are not listed as configs.
"""

from torchtitan.config.job_config import JobConfig
from torchtitan.models.common.presets import debug_run, pretraining_run, sft_debug_run


def llama3_debugmodel() -> JobConfig:
    """6-layer, 256-wide Llama 3 on the bundled corpus: trains in minutes on a laptop CPU."""
    return debug_run("llama3")


def llama3_debugmodel_sft() -> JobConfig:
    """The debug model fine-tuned on the bundled conversations (``--training.data_format
    chat``): trained on the answers only; add ``--lora.rank 8`` for LoRA."""
    return sft_debug_run("llama3")


def _pretraining(
    flavor: str, *, lr: float, local_batch_size: int, ac: str = "selective"
) -> JobConfig:
    """The full-size runs, 8192 tokens per sequence, with the real Llama 3 tokenizer."""
    return pretraining_run(
        "llama3", flavor, tokenizer_path="assets/hf/Llama-3.1-8B", lr=lr,
        local_batch_size=local_batch_size, seq_len=8192, ac=ac,
    )  # fmt: skip


def llama3_1b() -> JobConfig:
    return _pretraining("1B", lr=3e-4, local_batch_size=2)


def llama3_3b() -> JobConfig:
    return _pretraining("3B", lr=3e-4, local_batch_size=1)


def llama3_8b() -> JobConfig:
    return _pretraining("8B", lr=3e-4, local_batch_size=1)


def llama3_70b() -> JobConfig:
    return _pretraining("70B", lr=1.5e-4, local_batch_size=8, ac="full")


def llama3_405b() -> JobConfig:
    return _pretraining("405B", lr=8e-5, local_batch_size=2, ac="full")

"""Named DeepSeek-V3 training configs: ``--module deepseek_v3 --config <function name>``."""

from torchtitan.config.job_config import (
    ActivationCheckpoint,
    Checkpoint,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Training,
)


def deepseek_v3_debugmodel() -> JobConfig:
    """4 layers (1 dense, 3 with 8 experts, top-2, 1 shared), 256 wide, on the bundled corpus:
    trains in minutes on a laptop CPU."""
    return JobConfig(
        model=Model(
            name="deepseek_v3", flavor="debugmodel", tokenizer_path="tests/assets/tokenizer"
        ),
        training=Training(
            dataset="python_docs",
            local_batch_size=8,
            seq_len=512,
            steps=100,
            max_norm=1.0,
            mixed_precision_param="float32",
        ),
        optimizer=Optimizer(name="AdamW", lr=2e-3, weight_decay=0.1),
        lr_scheduler=LRScheduler(warmup_steps=10, decay_type="cosine", min_lr_factor=0.1),
        metrics=Metrics(log_freq=5),
        checkpoint=Checkpoint(interval=50),
    )


# The hub repository whose tokenizer each flavor uses (its tokenizer.json), downloaded into
# assets/hf/<name> by `python scripts/download_hf_assets.py --repo_id <repo> --assets tokenizer`.
TOKENIZER_REPOS = {"16B": "deepseek-ai/DeepSeek-V2-Lite", "671B": "deepseek-ai/DeepSeek-V3"}


def _pretraining(flavor: str, *, lr: float, local_batch_size: int, seq_len: int) -> JobConfig:
    """Shared settings of the full-size runs (C4; the model's own tokenizer, downloaded)."""
    return JobConfig(
        model=Model(
            name="deepseek_v3",
            flavor=flavor,
            tokenizer_path=f"assets/hf/{TOKENIZER_REPOS[flavor].split('/')[1]}",
            attn_mask="block_causal",
        ),
        training=Training(
            dataset="c4",
            local_batch_size=local_batch_size,
            seq_len=seq_len,
            steps=1000,
            max_norm=1.0,
            mixed_precision_param="bfloat16",
            # Tokenizing in a worker overlaps the GPU's step: measured on one H100 with
            # Llama 3 1B / 8B-class, loading in the step took 7-12% of it (docs/performance.md).
            num_workers=1,
        ),
        optimizer=Optimizer(name="AdamW", lr=lr),
        lr_scheduler=LRScheduler(warmup_steps=200, decay_type="linear", min_lr_factor=0.0),
        metrics=Metrics(log_freq=10, enable_tensorboard=True),
        checkpoint=Checkpoint(interval=500),
        activation_checkpoint=ActivationCheckpoint(mode="full"),
    )


def deepseek_v3_16b() -> JobConfig:
    return _pretraining("16B", lr=2.2e-4, local_batch_size=4, seq_len=4096)


def deepseek_v3_671b() -> JobConfig:
    return _pretraining("671B", lr=2.2e-4, local_batch_size=1, seq_len=4096)

"""Named Llama 3 training configs: ``--module llama3 --config <function name>``.

Each function returns a complete ``JobConfig``; TOML files and CLI flags layer on top.
Private helpers (leading underscore) are not listed as configs.
"""

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


def llama3_debugmodel() -> JobConfig:
    """6-layer, 256-wide Llama 3 on the bundled corpus: trains in minutes on a laptop CPU."""
    return JobConfig(
        model=Model(name="llama3", flavor="debugmodel", tokenizer_path="tests/assets/tokenizer"),
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


def _pretraining(
    flavor: str, *, lr: float, local_batch_size: int, seq_len: int = 8192, ac: str = "selective"
) -> JobConfig:
    """Shared settings of the full-size runs, on C4 with the real Llama 3 tokenizer."""
    return JobConfig(
        model=Model(
            name="llama3",
            flavor=flavor,
            tokenizer_path="assets/hf/Llama-3.1-8B",
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
        activation_checkpoint=ActivationCheckpoint(mode=ac),
    )


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

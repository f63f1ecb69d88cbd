"""The named configs every model family offers, built alike (no torch import: the config
pre-flight reads them): a debug run on the bundled corpus and tokenizer, and full-size
pretraining runs on C4, a debug fine-tuning run on the bundled conversations. A family's ``config_registry`` names its own on top of these."""

from torchtitan.config.job_config import (
    ActivationCheckpoint,
    Checkpoint,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Training,
    Validation,
)


def debug_run(name: str, flavor: str = "debugmodel") -> JobConfig:
    """A small flavor on the bundled corpus and tokenizer, fp32: trains in minutes on a CPU."""
    return JobConfig(
        model=Model(name=name, flavor=flavor, tokenizer_path="tests/assets/tokenizer"),
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


def sft_debug_run(name: str, flavor: str = "debugmodel") -> JobConfig:
    """``debug_run`` fine-tuned on the bundled conversations (answers only, packed whole
    under per-document attention), validated on held-out ones, ending with a chat sample."""
    config = debug_run(name, flavor)
    config.model.attn_mask = "block_causal"
    config.training.dataset = "chat_demo"
    config.training.data_format = "chat"
    config.training.seq_len = 256
    config.training.steps = 300
    config.validation = Validation(
        enable=True, dataset="chat_demo_validation", freq=100, sample_prompt="What is the "
        "json module for?"
    )  # fmt: skip
    return config


def pretraining_run(
    name: str,
    flavor: str,
    *,
    tokenizer_path: str,
    lr: float,
    local_batch_size: int,
    seq_len: int,
    ac: str = "selective",
) -> JobConfig:
    """A full-size flavor on C4 with the model's own tokenizer (downloaded into
    ``tokenizer_path``), per-document attention, bf16, activation checkpointing ``ac``."""
    return JobConfig(
        model=Model(
            name=name, flavor=flavor, tokenizer_path=tokenizer_path, attn_mask="block_causal"
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

"""Named configs of the toy family: ``MODULE=toy_family CONFIG=toy_debugmodel``."""

from torchtitan.config.job_config import JobConfig, LRScheduler, Model, Optimizer, Training


def toy_debugmodel() -> JobConfig:
    return JobConfig(
        model=Model(name="toy_family", flavor="tiny", tokenizer_path="tests/assets/tokenizer"),
        training=Training(local_batch_size=4, seq_len=64, steps=2, mixed_precision_param="float32"),
        optimizer=Optimizer(lr=1e-2),
        lr_scheduler=LRScheduler(warmup_steps=0),
    )

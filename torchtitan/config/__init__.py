"""Trainer configuration: dataclass sections (``job_config``) and their resolution (``manager``)."""

from torchtitan.config.job_config import JobConfig

__all__ = ["JobConfig"]

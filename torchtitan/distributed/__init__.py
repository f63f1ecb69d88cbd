"""Parallelism techniques, one module each; none of them knows about a particular model."""

from torchtitan.distributed.parallel_dims import ParallelDims, ParallelDimsError

__all__ = ["ParallelDims", "ParallelDimsError"]

"""Fixtures shared by the integration tests' modules."""

from slurm_cluster import slurm_cluster  # noqa: F401  (the local Slurm cluster, one test at a time)

"""Which torch this process runs: the code supports torch >= 2.11 and works around what
differs between versions (each workaround says which)."""

import torch


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch, e.g. ``(2, 13)`` for ``2.13.0+cpu``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)

"""Run the reference torchtitan's trainer with the two flavors ``bench_gpu.py`` compares.

    torchrun --standalone --nproc_per_node 1 benchmarks/reference_launch.py --model.flavor 1B ...

The reference's package must be first on ``PYTHONPATH`` (its ``torchtitan`` and ours share the
name; this file lives outside our package root, so the reference's is imported). Its Llama 3
has no 1B flavor and no 4-layer 8B: both are added here with our flavors' shapes. The 1B
output projection is untied there (it cannot tie), so it holds one more vocabulary x dim
matrix than ours (same FLOPs: the tied projection is a matmul per token too).
"""

import dataclasses
import sys

from torchtitan.models import llama3

if not hasattr(llama3, "llama3_args"):
    sys.exit("error: this imported our torchtitan: put the reference's first on PYTHONPATH")

from torchtitan.train import Trainer, main  # noqa: E402


def _add_flavors() -> None:
    base = llama3.llama3_args["8B"]
    llama3.llama3_args["8B_4layers"] = dataclasses.replace(base, n_layers=4)
    llama3.llama3_args["1B"] = dataclasses.replace(
        base, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
        multiple_of=256,
    )  # fmt: skip


if __name__ == "__main__":
    _add_flavors()
    main(Trainer)

"""A model family that lives outside the package and plugs in through the contract alone.

``tests/integration_tests/test_model_contract.py`` trains it with ``MODULE=toy_family`` and
``PYTHONPATH=tests/integration_tests``; ``docs/extending.md`` walks through it. Importing this
package does not import torch: the config pre-flight reads it before any rank starts.
"""

import dataclasses

from torchtitan.config.errors import ConfigError
from torchtitan.models.spec import ModelSpec, lazy
from toy_family import config_registry


@dataclasses.dataclass(frozen=True)
class ToyArgs:
    dim: int = 64
    n_layers: int = 2
    vocab_size: int = 2048
    max_seq_len: int = 64

    def num_params(self) -> int:
        block = 2 * self.dim * 4 * self.dim + self.dim  # up, down, norm
        return 2 * self.vocab_size * self.dim + self.n_layers * block + self.dim


def flops_per_token(args: ToyArgs, seq_len: int) -> float:
    """6 x parameters a token passes through (no attention: the blocks are per-token MLPs)."""
    return 6.0 * args.num_params()


def validate(config, parallel_dims) -> None:
    if parallel_dims.tp > 1:
        raise ConfigError(
            f"--parallelism.tensor_parallel_degree={parallel_dims.tp}: the toy family has no "
            "tensor-parallel plan; use data parallelism"
        )


model_spec = ModelSpec(
    name="toy_family",
    flavors={"tiny": ToyArgs()},
    config_registry=config_registry,
    build_model=lazy("toy_family.model:ToyModel"),
    parallelize=lazy("toy_family.model:parallelize_toy"),
    flops_per_token=flops_per_token,
    validate=validate,
)

"""``ParallelDims``: the parallel degrees of a run and the one place that builds device meshes.

Constructing one validates the degrees without importing torch, so the config pre-flight
can reject impossible layouts before any rank starts.

The world is laid out as ``pp x dp_replicate x dp_shard x cp x tp`` (outermost first, so TP
ranks are neighbours and share the fastest links). Flattened meshes that other components use,
from ``ParallelDims.mesh(name)`` once ``build_mesh`` has run:

- ``dp``: ``dp_replicate x dp_shard`` -- ranks that read different data;
- ``dp_shard_cp``: ``dp_shard x cp`` -- ranks FSDP shards parameters over;
- ``dp_cp``: ``dp_replicate x dp_shard x cp`` -- ranks the loss is averaged over.

With expert parallelism a second mesh over the same ranks splits ``dp_shard x cp x tp`` into
``efsdp x ep`` (``ep`` innermost: the TP ranks when TP is on, then CP ranks, then dp_shard
ranks): ``ep``, the ranks that split each MoE layer's experts;
``efsdp``, the ranks FSDP shards the experts over (``mesh("dp_replicate", "efsdp")`` for
HSDP).
"""

import dataclasses
import warnings
from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_FLAG = "--parallelism."


class ParallelDimsError(ConfigError):
    """Degrees that cannot be laid out; the message names the flag and the fix."""


@dataclasses.dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    replicas_apart: bool = False
    """Semi-synchronous training (``--semi_sync.method``): the dp_replicate replicas reduce no
    gradients between them, each shards over its own ``dp_shard_cp`` ranks, and they meet
    every few steps (``distributed/semi_sync.py``)."""
    # Filled by build_mesh: the world mesh ("world") and the flattened meshes by name; then by
    # mesh(): every slice asked for, by name or tuple of names.
    _meshes: dict[str | tuple[str, ...], "DeviceMesh"] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def from_config(
        cls, parallelism, world_size: int, *, replicas_apart: bool = False
    ) -> "ParallelDims":
        """From the ``parallelism`` config section and the number of ranks."""
        return cls(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            cp=parallelism.context_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            ep=parallelism.expert_parallel_degree,
            world_size=world_size,
            replicas_apart=replicas_apart,
        )

    def __post_init__(self) -> None:
        self._resolve_and_validate()

    def _resolve_and_validate(self) -> None:
        named = {
            "data_parallel_replicate_degree": self.dp_replicate,
            "context_parallel_degree": self.cp,
            "tensor_parallel_degree": self.tp,
            "pipeline_parallel_degree": self.pp,
            "expert_parallel_degree": self.ep,
        }
        for name, degree in named.items():
            if degree < 1:
                raise ParallelDimsError(f"{_FLAG}{name}={degree} must be >= 1")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ParallelDimsError(
                f"{_FLAG}data_parallel_shard_degree={self.dp_shard} must be -1 (auto) or >= 1"
            )
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelDimsError(
                    f"world size {self.world_size} is not divisible by dp_replicate x cp x tp x "
                    f"pp = {self.dp_replicate} x {self.cp} x {self.tp} x {self.pp} = {others}; "
                    f"change the {_FLAG}*_degree flags or the number of ranks (NGPU)"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ParallelDimsError(
                f"dp_replicate x dp_shard x cp x tp x pp = {self.dp_replicate} x {self.dp_shard} "
                f"x {self.cp} x {self.tp} x {self.pp} = {product} != world size "
                f"{self.world_size}; set {_FLAG}data_parallel_shard_degree=-1 to fill the rest, "
                f"or launch with NGPU={product}"
            )
        if self.ep > 1:
            # Experts borrow the innermost ranks of dp_shard x cp x tp: the TP ranks first
            # (each TP rank then routes its own sequence shard), then CP, then dp_shard ranks.
            borrowed = self.dp_shard * self.cp * self.tp
            if borrowed % self.ep:
                raise ParallelDimsError(
                    f"{_FLAG}expert_parallel_degree={self.ep} must divide dp_shard x cp x tp = "
                    f"{self.dp_shard} x {self.cp} x {self.tp} = {borrowed}: experts borrow "
                    "their ranks from those dimensions"
                )
            if self.tp > 1 and self.ep % self.tp:
                raise ParallelDimsError(
                    f"{_FLAG}expert_parallel_degree={self.ep} with tensor_parallel_degree="
                    f"{self.tp}: expert parallelism spans the TP ranks, so it must be a "
                    f"multiple of {self.tp}"
                )

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def replicas_reduce_gradients(self) -> bool:
        """Whether gradients are reduced over dp_replicate every step (HSDP, DDP)."""
        return self.dp_replicate_enabled and not self.replicas_apart

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ep_data_parallel(self) -> int:
        """The ranks of one expert-parallel group that gradients are averaged over (dp_shard
        and cp ranks): ``ep``, or ``ep / tp`` where the group spans the TP ranks."""
        return self.ep // self.tp if self.tp > 1 else self.ep

    @property
    def dp_degree(self) -> int:
        """Ranks that read different data: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    def global_batch_size(self, local_batch_size: int, global_batch_size: int) -> int:
        """Sequences per optimizer step (``--training.global_batch_size``, -1 = one
        accumulation batch of ``local_batch_size`` on every data-parallel rank)."""
        per_step = local_batch_size * self.dp_degree
        return per_step if global_batch_size == -1 else global_batch_size

    def grad_accum_steps(self, local_batch_size: int, global_batch_size: int) -> int:
        """Gradient-accumulation batches per optimizer step on each data-parallel rank."""
        per_step = local_batch_size * self.dp_degree
        total = self.global_batch_size(local_batch_size, global_batch_size)
        if total % per_step:
            raise ConfigError(
                f"--training.global_batch_size={total} must be a multiple of "
                f"--training.local_batch_size x data-parallel degree = {local_batch_size} x "
                f"{self.dp_degree} = {per_step}"
            )
        return total // per_step

    def build_mesh(self, device_type: str) -> "DeviceMesh":
        """Create the world mesh with every named and flattened dimension (once per run)."""
        # Imported here so validating degrees (config pre-flight) does not import torch.
        from torch.distributed.device_mesh import init_device_mesh

        dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
        ]
        mesh = init_device_mesh(
            device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims)
        )
        # Kept here: torch warns that slicing flattened dims from the root will go away.
        self._meshes = {
            "world": mesh,
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        if self.ep > 1:
            # The same ranks in the same order, dp_shard x cp x tp (row-major) split as
            # efsdp x ep: ep takes the innermost ranks (TP's, then CP's, then dp_shard's).
            efsdp = self.dp_shard * self.cp // self.ep_data_parallel
            experts = init_device_mesh(
                device_type,
                (self.pp, self.dp_replicate, efsdp, self.ep),
                mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"),
            )
            self._meshes |= {"experts": experts, "ep": experts["ep"], "efsdp": experts["efsdp"]}
        return mesh

    @property
    def meshes_built(self) -> bool:
        """Whether ``build_mesh`` has run (every run with more than one rank)."""
        return "world" in self._meshes

    def data_parallel_mesh(self) -> "DeviceMesh":
        """What data parallelism shards or replicates over: ``dp_shard_cp`` (FSDP),
        ``(dp_replicate, dp_shard_cp)`` (HSDP) or ``dp_replicate`` (replicas only); with
        ``replicas_apart``, ``dp_shard_cp``."""
        if not self.replicas_reduce_gradients:
            return self.mesh("dp_shard_cp")
        if self.fsdp_enabled:
            return self.mesh("dp_replicate", "dp_shard_cp")
        return self.mesh("dp_replicate")

    def gradient_mesh(self) -> "DeviceMesh":
        """The ranks whose tokens make up one gradient (averaged over them): ``dp_cp``, or a
        replica's ``dp_shard_cp`` when replicas train apart. Needs ``build_mesh``."""
        return self.mesh("dp_shard_cp" if self.replicas_apart else "dp_cp")

    def mesh(self, *names: str) -> "DeviceMesh":
        """A dimension of the world mesh (named or flattened), or several named ones as one
        mesh, e.g. ``mesh("dp_replicate", "dp_shard_cp")`` for HSDP. Needs ``build_mesh``."""
        if not self.meshes_built:
            raise RuntimeError("ParallelDims.mesh() needs build_mesh() first")
        key = names[0] if len(names) == 1 else names
        if key not in self._meshes:
            # Kept: slicing builds a new mesh object each time, and identity matters (torch's
            # simulated ranks cache coordinates by id(mesh): local_tensor.simulation_mode).
            self._meshes[key] = self._slice(names)
        return self._meshes[key]

    def _slice(self, names: tuple[str, ...]) -> "DeviceMesh":
        if "ep" in names or "efsdp" in names:  # e.g. ("dp_replicate", "efsdp"): HSDP of experts
            return self._meshes["experts"][names]
        if names == ("dp_replicate", "dp_shard_cp") and self.cp == 1:
            names = ("dp_replicate", "dp_shard")  # the same ranks while cp is 1
        elif names == ("dp_replicate", "dp_shard_cp"):
            with warnings.catch_warnings():
                # torch 2.11-2.13 warn that slicing a flattened dim from the root will go away,
                # and offer no other way to pair it with another dim.
                warnings.simplefilter("ignore", UserWarning)
                return self._meshes["world"][names]
        return self._meshes["world"][names]

    def __str__(self) -> str:
        degrees = ", ".join(
            f"{k}={getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
        )
        return f"ParallelDims({degrees}, world_size={self.world_size})"

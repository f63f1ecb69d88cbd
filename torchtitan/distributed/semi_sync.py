"""Semi-synchronous data parallelism over the ``dp_replicate`` replicas: LocalSGD and (streaming)
DiLoCo.

Each replica trains on its own share of the global batch and reduces gradients only among its
own ranks (``ParallelDims.replicas_apart``: FSDP over ``dp_shard_cp``, TP, CP, PP, EP inside it
as usual). Every ``--semi_sync.sync_steps`` steps the replicas meet over the ``dp_replicate``
group, one all-reduce per fragment of the weights:

- ``local_sgd``: the replicas' weights are averaged;
- ``diloco``: the mean of the replicas' changes since the last sync (the pseudo-gradient,
  ``synced - own``) is applied to the synced weights by SGD with Nesterov momentum (the outer
  step), and every replica takes the result (or mixes it with its own,
  ``--semi_sync.fragment_update_alpha``).

Streaming DiLoCo splits the blocks into ``--semi_sync.num_fragments`` fragments of consecutive
blocks, each synced at its own offset within the ``sync_steps`` steps.

Only trainable parameters meet: buffers that change (MoE routing biases) are updated from counts
summed over every data-parallel rank, so they stay equal across replicas by themselves.

A checkpoint's ``model`` holds the synced weights (the outer parameters: what every replica
would hold after a sync with nothing since), so it loads, converts and samples like any other;
the ``semi_sync`` state holds each replica's own weights under ``replica<r>.<name>`` and the
outer momentum, and the optimizer's moments are kept per replica too (``Optimizers.replica_key``).
"""

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.config.errors import ConfigError
from torchtitan.config.execution import SemiSync as SemiSyncConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import total_norm
from torchtitan.tools.logging import logger
from torchtitan.tools.module_names import clean_name

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclasses.dataclass
class _Weight:
    """One trainable parameter of this rank: its names in the model's state dict (a tied
    weight has several), the parameter itself and its fragment."""

    names: list[str]
    live: torch.Tensor
    fragment: int

    @property
    def local(self) -> torch.Tensor:
        return self.live.to_local() if isinstance(self.live, DTensor) else self.live

    def like(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` laid out as the parameter is (a DTensor of the same mesh and placements)."""
        if not isinstance(self.live, DTensor):
            return local
        live = self.live
        return DTensor.from_local(
            local, live.device_mesh, live.placements, run_check=False,
            shape=live.shape, stride=live.stride(),
        )  # fmt: skip


def fragment_of(name: str, num_fragments: int, n_layers: int) -> int:
    """The fragment of the parameter ``name``: block ``i`` of ``n_layers`` in fragment
    ``i x num_fragments // n_layers``, the token embedding in the first, everything else
    outside the blocks (final norm, output) in the last."""
    if (block := _BLOCK.search(name)) is not None:
        return int(block.group(1)) * num_fragments // n_layers
    return 0 if name.startswith("tok_embeddings") else num_fragments - 1


def sync_offset(fragment: int, num_fragments: int, sync_steps: int) -> int:
    """Steps ``t`` with ``t % sync_steps`` equal to this sync ``fragment``: evenly spread, the
    last fragment (with one fragment, the whole model) at multiples of ``sync_steps``."""
    return (fragment + 1) * sync_steps // num_fragments % sync_steps


class SemiSync(Stateful):
    """The replicas' meetings, and the checkpoint state ``semi_sync``.

    Built before the checkpoint loads; :meth:`start` after it (the weights then in the model
    are the synced ones); :meth:`after_step` after every training step."""

    def __init__(
        self,
        config: SemiSyncConfig,
        model_parts: Sequence[nn.Module],
        *,
        group: dist.ProcessGroup | None,
        replica: int,
        replicas: int,
        n_layers: int,
        pp_mesh: DeviceMesh | None = None,
        after_change: Callable[[], object] | None = None,
        before_change: Callable[[], object] | None = None,
    ):
        self.config, self.group = config, group
        self.replica, self.replicas = replica, replicas
        self.pp_mesh, self.after_change, self.before_change = pp_mesh, after_change, before_change
        self.weights = _trainable_weights(model_parts, config.num_fragments, n_layers)
        self.diloco = config.method == "diloco"
        self.momentum = [torch.zeros_like(w.local) for w in self.weights] if self.diloco else []
        self.synced: list[torch.Tensor] | None = None  # local shards of the last sync's weights
        self._incoming: list[torch.Tensor] | None = None  # this replica's own, being loaded
        self._loaded = False
        self.last_norm: torch.Tensor | None = None  # the pseudo-gradient norm of the last sync

    @classmethod
    def build(
        cls, config: SemiSyncConfig, model_parts: Sequence[nn.Module],
        parallel_dims: ParallelDims, *, n_layers: int,
        after_change: Callable[[], object] | None = None,
        before_change: Callable[[], object] | None = None,
    ) -> "SemiSync | None":  # fmt: skip
        """``None`` unless ``--semi_sync.method`` is set. ``before_change`` / ``after_change``:
        called around a meeting that changes the weights (a checkpoint's staging copy must be
        finished before; float8's scales recomputed after)."""
        if config.method == "none":
            return None
        if config.num_fragments > n_layers:
            raise ConfigError(
                f"--semi_sync.num_fragments={config.num_fragments} is more than the model's "
                f"{n_layers} blocks; use at most {n_layers}"
            )
        mesh = parallel_dims.mesh("dp_replicate")
        pp = parallel_dims.mesh("pp") if parallel_dims.pp_enabled else None
        return cls(
            config, model_parts, group=mesh.get_group(), replica=mesh.get_local_rank(),
            replicas=mesh.size(), n_layers=n_layers, pp_mesh=pp, after_change=after_change,
            before_change=before_change,
        )  # fmt: skip

    def describe(self) -> str:
        c = self.config
        what = (
            f"DiLoCo (outer SGD lr {c.outer_lr:g}, "
            + (f"{'Nesterov ' if c.outer_nesterov else ''}momentum {c.outer_momentum:g})")
            if self.diloco
            else "LocalSGD (weights averaged)"
        )
        numel = sum(w.local.numel() for w in self.weights)
        streamed = (
            f" in {c.num_fragments} fragments, one every "
            + (
                "step"
                if c.sync_steps == c.num_fragments
                else f"{c.sync_steps // c.num_fragments} steps"
            )
            if c.num_fragments > 1
            else ""
        )
        return (
            f"Semi-synchronous training: {what} over {self.replicas} replicas, syncing every "
            f"{c.sync_steps} steps{streamed}; this rank exchanges {numel:,} weights per "
            f"{c.sync_steps} steps, no gradient between replicas"
        )

    # ---- training ----------------------------------------------------------------------------

    def start(self) -> None:
        """After the checkpoint (if any) has loaded: the model's weights are the synced ones;
        this replica's own, if the checkpoint held them, replace them."""
        logger.info(self.describe())
        self.synced = [w.local.detach().clone() for w in self.weights]
        if self._loaded and self._incoming is not None:
            with torch.no_grad():
                for w, own in zip(self.weights, self._incoming, strict=True):
                    w.local.copy_(own)
            if self.after_change is not None:
                self.after_change()
        self._incoming = None

    def due(self, step: int) -> list[int]:
        """The fragments that sync after ``step``."""
        c = self.config
        return [
            f
            for f in range(c.num_fragments)
            if step % c.sync_steps == sync_offset(f, c.num_fragments, c.sync_steps)
        ]

    def after_step(self, step: int) -> bool:
        """Sync the fragments due after ``step`` (skipped updates included: the replicas
        meet on schedule); whether any did."""
        fragments = self.due(step)
        if not fragments:
            return False
        if self.before_change is not None:
            self.before_change()
        norms = [self._sync(fragment) for fragment in fragments]
        self.last_norm = torch.linalg.vector_norm(torch.stack(norms))  # read when logged
        if self.after_change is not None:
            self.after_change()
        return True

    @torch.no_grad()
    def _sync(self, fragment: int) -> torch.Tensor:
        """One fragment's meeting; returns the norm of its pseudo-gradient (the replicas' mean
        change since the last sync). Every rank of a pipeline stage holds the same fragments,
        so ranks without a weight in it (other stages') skip the exchange alike; all join the
        norm's sum over the stages."""
        index = [i for i, w in enumerate(self.weights) if w.fragment == fragment]
        if not index:
            return total_norm([], pp_mesh=self.pp_mesh)
        own = [self.weights[i].local for i in index]
        synced = [self.synced[i] for i in index]
        # One float32 buffer for the fragment, whatever the parameters' dtype, in one
        # all-reduce: DiLoCo sums the replicas' pseudo-gradients, LocalSGD their weights.
        flat = torch.empty(sum(o.numel() for o in own), dtype=torch.float32, device=own[0].device)
        means = [
            m.view_as(o) for m, o in zip(flat.split([o.numel() for o in own]), own, strict=True)
        ]
        for mean, s, o in zip(means, synced, own, strict=True):
            if self.diloco:
                mean.copy_(s).sub_(o)
            else:
                mean.copy_(o)
        if self.group is not None and self.replicas > 1:
            dist.all_reduce(flat, group=self.group)
        flat.div_(self.replicas)
        c = self.config
        for i, o, s, mean in zip(index, own, synced, means, strict=True):
            if self.diloco:
                m = self.momentum[i]
                m.mul_(c.outer_momentum).add_(mean)
                step = mean.add(m, alpha=c.outer_momentum) if c.outer_nesterov else m
                s.sub_(step.to(s.dtype), alpha=c.outer_lr)
            else:
                moved = s.float() - mean  # the change the mean makes (one tensor at a time)
                s.copy_(mean)
                mean.copy_(moved)  # the buffer now holds the pseudo-gradient
            if c.fragment_update_alpha == 0:
                o.copy_(s)
            else:
                o.mul_(c.fragment_update_alpha).add_(s, alpha=1 - c.fragment_update_alpha)
        return total_norm([self.weights[i].like(m) for i, m in zip(index, means, strict=True)],
                          pp_mesh=self.pp_mesh)  # fmt: skip

    def agreed_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """One gradient norm for every rank from the replicas' own (each replica clips its
        gradient by its own): their root mean square, NaN or inf if any is. The verdicts on a
        step (non-finite, spike) and the logged norm are then the same on every rank."""
        if self.group is None or self.replicas == 1:
            return norm
        squared = norm.double().square()
        dist.all_reduce(squared, group=self.group)
        return (squared / self.replicas).sqrt().float()

    def meetings_through(self, step: int) -> int:
        """Steps up to ``step`` after which a fragment met (one fragment a meeting)."""
        c, count = self.config, 0
        for fragment in range(c.num_fragments):
            first = sync_offset(fragment, c.num_fragments, c.sync_steps) or c.sync_steps
            if step >= first:
                count += (step - first) // c.sync_steps + 1
        return count

    def metrics(self, step: int) -> dict[str, float]:
        """For the log line of ``step``: meetings so far and the last one's pseudo-gradient
        norm (none yet after a resume, until the next meeting)."""
        extra: dict[str, float] = {"semi_sync_syncs": self.meetings_through(step)}
        if self.last_norm is not None:
            extra["semi_sync_pseudo_grad_norm"] = self.last_norm.item()
        return extra

    # ---- checkpoint --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.synced is None:  # a load: this replica's weights arrive beside the model's
            if self._incoming is None:
                self._incoming = [torch.empty_like(w.local) for w in self.weights]
            own = self._incoming
        else:
            own = [w.local for w in self.weights]
        state = {
            f"replica{self.replica}.{w.names[0]}": w.like(t)
            for w, t in zip(self.weights, own, strict=True)
        }
        if self.diloco:
            state |= {
                f"momentum.{w.names[0]}": w.like(m)
                for w, m in zip(self.weights, self.momentum, strict=True)
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # DCP has read into the tensors state_dict() handed out: start() moves them in.
        self._loaded = True

    def synced_view(self, state: dict[str, Any]) -> dict[str, Any]:
        """A model state dict with each trainable weight replaced by its synced value."""
        if self.synced is None:
            return state
        by_name = {
            name: w.like(s)
            for w, s in zip(self.weights, self.synced, strict=True)
            for name in w.names
        }
        if missing := sorted(set(by_name) - set(state)):  # a name the state dict spells otherwise
            raise RuntimeError(f"the model's state dict lacks the trainable weights {missing[:3]}")
        return {k: by_name.get(k, v) for k, v in state.items()}


def _trainable_weights(
    model_parts: Sequence[nn.Module], num_fragments: int, n_layers: int
) -> list[_Weight]:
    """The trainable parameters of ``model_parts`` under their state-dict names (the names
    without the wrappers' parts), tied ones once."""
    weights: dict[int, _Weight] = {}
    for part in model_parts:
        for name, p in part.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                continue
            name = clean_name(name)
            if id(p) in weights:
                weights[id(p)].names.append(name)
            else:
                weights[id(p)] = _Weight([name], p, fragment_of(name, num_fragments, n_layers))
    return list(weights.values())

"""Pipeline parallelism: cut a model into stages, wrap this rank's as ``PipelineStage``s, and
build the schedule that runs them (``torch.distributed.pipelining``).

Which module goes to which stage is the model's plan (``ModelSpec.pipeline``); which stage
goes to which rank is ``pipeline_split``. Each stage is a standalone copy of the model with the
other stages' modules removed, so the model's own ``parallelize`` (TP -> AC -> compile -> FSDP)
wraps it like a whole model and its parameters keep their names (``layers.3`` stays
``layers.3``): checkpoints of any split load into any other.

Every stage is given the shapes and dtypes of what it receives and sends: without them torch
infers them by running one extra forward and backward per stage on the first step, which would
add to the gradients, the logged loss and the RNG state.
"""

import copy
import inspect
import logging
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)
from torch.distributed.tensor import DTensor, Shard

from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.pipeline_split import SCHEDULES_LOGGER, check_module_names

_STATIC_GRADS = "input_grads" in inspect.signature(PipelineStage.__init__).parameters


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose first step does not pair a rank with itself.

    Before the first step a schedule sends a dummy tensor to each stage's neighbours to open
    the connections. Where two neighbouring stages sit on one rank (V-shaped schedules:
    ZBVZeroBubble, DualPipeV) that is a send to itself, which torch 2.11's gloo refuses
    ("Pair is not connected"); those stages hand activations over in memory, so there is
    nothing to open."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if op.group_peer != self.group_rank]


def cut_model(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """A copy of ``model`` holding only the modules ``names``: top-level children not named are
    set to ``None``, entries of a ``ModuleDict`` child (the blocks) not named are deleted."""
    part = copy.deepcopy(model)
    keep = set(names)
    for child_name, child in list(part.named_children()):
        if child_name in keep:
            continue
        if isinstance(child, nn.ModuleDict):
            for key in list(child.keys()):
                if f"{child_name}.{key}" not in keep:
                    del child[key]
        else:
            setattr(part, child_name, None)
    return part


def check_split(model: nn.Module, names_per_stage: Sequence[Sequence[str]]) -> None:
    """Every module of ``model`` is on exactly one stage, and every name is a module."""
    units = []
    for child_name, child in model.named_children():
        if isinstance(child, nn.ModuleDict):
            units += [f"{child_name}.{key}" for key in child.keys()]
        else:
            units.append(child_name)
    check_module_names(names_per_stage, units)


def build_stages(
    model: nn.Module,
    names_per_stage: Sequence[Sequence[str]],
    *,
    local_stages: Sequence[int],
    pp_mesh: DeviceMesh,
    parallelize: Callable[[nn.Module], nn.Module],
    device: torch.device,
    microbatch_size: int,
    seq_len: int,
    hidden_dtype: torch.dtype,
    output_dtype: torch.dtype,
    tp_mesh: DeviceMesh | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> tuple[list[PipelineStage], list[nn.Module]]:
    """This rank's stages (``local_stages``) of ``model`` (built on meta), each cut,
    parallelized and wrapped. ``hidden_dtype`` is what travels between stages,
    ``output_dtype`` the last stage's logits.

    Under tensor parallelism (``tp_mesh``) the stage boundaries follow the layout every TP plan
    here uses between blocks: the residual stream is a plain local tensor, sharded along the
    sequence (dim 1) with ``sequence_parallel`` and whole otherwise; the logits are a
    vocabulary-sharded DTensor with ``loss_parallel``, else a whole plain tensor.
    """
    check_split(model, names_per_stage)
    num_stages = len(names_per_stage)
    stages, parts = [], []
    example = torch.empty(microbatch_size, seq_len, dtype=torch.long, device="meta")
    meta_input = example
    for index, names in enumerate(names_per_stage):
        part = cut_model(model, names)
        # Shapes from a forward on the meta device (no memory, no compute), in the parameters'
        # dtype; what travels is then given the dtype of the real run.
        with torch.no_grad():
            meta_input = part(meta_input)
        last = index == num_stages - 1
        output = _boundary(
            meta_input,
            dtype=output_dtype if last else hidden_dtype,
            tp_mesh=tp_mesh,
            sharded_dim=(-1 if loss_parallel else None)
            if last
            else (1 if sequence_parallel else None),
            as_dtensor=last and loss_parallel,
        )
        if index in local_stages:
            part = parallelize(part)
            grads = {}
            if _STATIC_GRADS:
                grads = dict(
                    input_grads=(None if index == 0 else example,),
                    output_grads=(None if last else output,),
                )
            stages.append(
                _Stage(
                    part,
                    index,
                    num_stages,
                    device,
                    input_args=(example,),
                    output_args=(output,),
                    group=pp_mesh.get_group(),
                    **grads,
                )
            )
            parts.append(part)
        example = output
    return stages, parts


def _boundary(
    full: torch.Tensor,
    *,
    dtype: torch.dtype,
    tp_mesh: DeviceMesh | None,
    sharded_dim: int | None,
    as_dtensor: bool,
) -> torch.Tensor:
    """What a stage sends (or outputs), on meta, from its unsharded shape ``full``.
    ``requires_grad`` marks what gradients flow back through."""
    shape = list(full.shape)
    if tp_mesh is not None and sharded_dim is not None:
        shape[sharded_dim] //= tp_mesh.size()
    local = torch.empty(shape, dtype=dtype, device="meta")
    if tp_mesh is not None and as_dtensor:
        dtensor = DTensor.from_local(local, tp_mesh, [Shard(sharded_dim)], run_check=False)
        return dtensor.requires_grad_(True)
    return local.requires_grad_(True)


def _not_a_lost_peer(record: logging.LogRecord) -> bool:
    """A log filter: drops what a multi-stage schedule logs (the error, then its whole
    timetable, 90 lines) while it handles another rank's going away; the entry point says that
    in one line and the launcher names the rank that failed."""
    error = sys.exc_info()[1]
    return error is None or dist_utils.lost_peer(error) is None


def build_schedule(
    stages: list[PipelineStage],
    *,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    csv_path: str | None = None,
) -> _PipelineSchedule:
    """The schedule ``schedule`` (or the one written in ``csv_path``) over this rank's stages.
    ``loss_fn`` returns the scaled loss (gradients are not scaled again by the schedule)."""
    logging.getLogger(SCHEDULES_LOGGER).addFilter(_not_a_lost_peer)  # once: a set
    if csv_path:
        # torch adds the sends, receives and gradient reductions to the compute actions.
        runtime = _PipelineScheduleRuntime(
            stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False
        )
        runtime._load_csv(csv_path, format="compute_only")
        return runtime
    cls = get_schedule_class(schedule)
    held = stages[0] if issubclass(cls, PipelineScheduleSingle) else stages
    return cls(held, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)

"""Moves a batch through the model parts: the one place that knows how a step's compute runs.

The ``BatchRunner`` owns everything that wraps the model's forward and backward: bf16 autocast
(when ``distributed.precision`` says no data-parallel policy casts already), loss parallelism
under tensor parallelism, the loss scale, and when gradients are reduced across
gradient-accumulation batches. The scale is applied inside the loss function (:class:`ScaledLoss`), the one place a
pipeline schedule, which calls the loss itself, can apply it too. The pipeline schedule and the
context-parallel split of each batch (:meth:`BatchRunner.local_part`) live here: this is the
only module that asks whether pipeline or context parallelism is on. The trainer decides *what*
a step is (token counts over the local parts, clipping, the optimizer); the runner only runs
batches.

Batches are named by what splits them: a step's *accumulation batches* are the
``--training.local_batch_size`` slices a rank runs one after the other before the optimizer
step; *pipeline micro-batches* (``--parallelism.pipeline_parallel_microbatch_size``) split one
accumulation batch further inside a pipeline schedule.
"""

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan.components.dataloader import document_ids
from torchtitan.components.loss import cross_entropy_sum
from torchtitan.distributed import (
    context_parallel,
    local_tensor,
    precision,
    tensor_parallel,
)
from torchtitan.distributed.compile import backend as compile_backend
from torchtitan.models.spec import ParallelizeContext

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]
"""``({"input": tokens [bs, seq]}, labels [bs, seq])``, on the host until the runner moves it.
This rank's part of a batch (:meth:`BatchRunner.local_part`) may add ``"document_ids"`` and
``"positions"``; every entry but ``"input"`` goes to the model as a keyword."""


class ScaledLoss:
    """The training loss as the model's caller (the runner, or a pipeline schedule) calls it:
    ``loss_fn(logits, labels)`` returns the summed token loss times ``scale``.

    The unscaled sums are kept, detached, for logging: :meth:`take_sum` returns and clears them.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn = loss_fn
        self.scale = 1.0
        self._sums: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, labels)
        detached = loss.detach()
        # Under loss parallelism the loss is a DTensor, already summed over the TP ranks.
        self._sums.append(detached.to_local() if isinstance(detached, DTensor) else detached)
        return loss * self.scale

    def take_sum(self, device: torch.device) -> torch.Tensor:
        """The summed losses since the last call, added in float64: exact for float32 values,
        so the logged loss does not depend on how the global batch was split."""
        total = torch.zeros((), device=device, dtype=torch.float64)
        for loss in self._sums:
            total += loss
        self._sums.clear()
        return total


class BatchRunner:
    """Runs this rank's batches through ``model_parts``: one part without pipelining, else this
    rank's pipeline ``stages`` (one per part) under the configured schedule. With
    ``document_start`` (the begin-of-text token) the model also gets each token's
    ``document_ids``, for block-causal attention."""

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        context: ParallelizeContext,
        device: torch.device,
        stages: Sequence["PipelineStage"] = (),
        *,
        document_start: int | None = None,
    ):
        self.model_parts = list(model_parts)
        self.device = device
        dims = context.parallel_dims
        self.autocast = precision.autocast_context(dims, context.training, device.type)
        self.loss_parallel = dims.tp_enabled and not context.parallelism.disable_loss_parallel
        loss_fn = functools.partial(cross_entropy_sum, chunks=context.training.loss_chunks)
        c = context.compile
        # Compiled, the vocab-sharded loss ignores loss_parallel and returns a wrong value.
        if c.enable and "loss" in c.components and not self.loss_parallel:
            loss_fn = torch.compile(loss_fn, backend=compile_backend(c))
        self.loss_fn = ScaledLoss(loss_fn)
        # Modules that add a loss term of their own (MoE balance losses) weigh it like the
        # tokens it was computed on: they read the gradient weight of one token's loss.
        self._own_loss_modules = [
            m for part in self.model_parts for m in part.modules() if hasattr(m, "loss_scale")
        ]
        self.cp_mesh = dims.mesh("cp") if dims.cp_enabled else None
        self.cp_load_balance = context.parallelism.context_parallel_load_balance
        self.document_start = document_start
        self.schedule = None
        if stages:
            p = context.parallelism
            # Imported here: torch.distributed.pipelining loads dynamo (0.6 s of a rank's
            # start), which only pipelined runs need.
            from torchtitan.distributed import pipeline_parallel

            self.schedule = pipeline_parallel.build_schedule(
                list(stages),
                schedule=p.pipeline_parallel_schedule,
                n_microbatches=context.training.local_batch_size
                // p.pipeline_parallel_microbatch_size,
                loss_fn=self.loss_fn,
                csv_path=p.pipeline_parallel_schedule_csv,
            )
            self._pipeline_seconds = [0.0, 0.0]  # wall, process CPU, since the last reading
            self._first_stage = any(stage.is_first for stage in stages)
            self._last_stage = any(stage.is_last for stage in stages)
            self._pp_group = dims.mesh("pp").get_group()

    def local_part(self, batch: Batch) -> Batch:
        """What this rank computes of a data-parallel rank's batch (host tensors): the tokens'
        ``document_ids`` for block-causal attention; under context parallelism this rank's share
        of every sequence, with the tokens' ``positions``. The runner's other methods take such
        parts."""
        inputs, labels = batch
        if self.document_start is not None and "document_ids" not in inputs:
            # (Fine-tuning data numbers its packed samples itself.)
            inputs = inputs | {"document_ids": document_ids(inputs["input"], self.document_start)}
        if self.cp_mesh is None:
            return inputs, labels
        return context_parallel.shard_batch(
            inputs, labels, self.cp_mesh, load_balance=self.cp_load_balance
        )

    def forward_backward(self, batches: Sequence[Batch], *, scale: float) -> torch.Tensor:
        """Forward and backward over a step's accumulation batches (local parts), each
        ``loss x scale``; gradients accumulate in the parameters and are reduced across
        data-parallel ranks once, after the last batch. Returns the summed token loss
        (float64, detached)."""
        self.loss_fn.scale = scale
        for module in self._own_loss_modules:
            module.loss_scale = scale
        for i, batch in enumerate(batches):
            inputs, labels = self._to_device(batch)
            if self.schedule is not None:
                # The stages reduce gradients after their last micro-batch themselves.
                with self._context():
                    self._pipeline_step(inputs, labels)
                continue
            self._reduce_gradients(i == len(batches) - 1)
            with self._context():
                logits = self._model(inputs["input"], **_keywords(inputs))
                loss = self.loss_fn(logits, labels)
                del logits
                loss.backward()
        total = self.loss_fn.take_sum(self.device)
        if self.schedule is not None:
            # Only the ranks holding the last stage computed the loss: every rank logs it.
            dist.all_reduce(total, group=self._pp_group)
        return total

    def _pipeline_step(self, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        """One accumulation batch through the schedule: tokens enter the first stage, labels
        meet the output at the last, keywords (document ids, positions) reach every stage; the
        schedule runs forward and backward per micro-batch."""
        tokens = (inputs["input"],) if self._first_stage else ()
        target = labels if self._last_stage else None
        wall, cpu = time.perf_counter(), time.process_time()
        self.schedule.step(
            *tokens, target=target, losses=[], return_outputs=False, **_keywords(inputs)
        )
        self._pipeline_seconds[0] += time.perf_counter() - wall
        self._pipeline_seconds[1] += time.process_time() - cpu

    def take_pipeline_idle(self) -> float | None:
        """The share of the pipeline steps since the last call this rank spent waiting (its
        bubble), measured on CPU as 1 - process CPU time / (wall time x threads); ``None``
        without pipelining, on an accelerator (its kernels run asynchronously) or when ranks are
        simulated. Other threads' work (gloo, a checkpoint writer) counts as busy: a lower
        bound."""
        if self.schedule is None or self.device.type != "cpu" or local_tensor.is_simulating():
            return None  # simulated pipeline ranks take turns on one thread at a time
        (wall, cpu), self._pipeline_seconds = self._pipeline_seconds, [0.0, 0.0]
        return max(0.0, 1 - cpu / max(wall * torch.get_num_threads(), 1e-9))

    @torch.no_grad()
    def loss(self, batch: Batch) -> torch.Tensor:
        """Forward only: the summed token loss of one batch (a local part, float64), for
        validation. The model parts run in eval mode (MoE layers neither count tokens for
        their balancing nor add a balance loss); no gradients and no state are left behind.
        Under pipeline parallelism the schedule runs forward only, in the training batch's
        micro-batches."""
        inputs, labels = self._to_device(batch)
        self.loss_fn.scale = 1.0
        modes = [part.training for part in self.model_parts]
        for part in self.model_parts:
            part.eval()
        try:
            with self._context():
                if self.schedule is not None:
                    tokens = (inputs["input"],) if self._first_stage else ()
                    target = labels if self._last_stage else None
                    self.schedule.eval(
                        *tokens, target=target, losses=[], return_outputs=False,
                        **_keywords(inputs),
                    )  # fmt: skip
                else:
                    self.loss_fn(self._model(inputs["input"], **_keywords(inputs)), labels)
        finally:
            for part, training in zip(self.model_parts, modes, strict=True):
                part.train(training)
        total = self.loss_fn.take_sum(self.device)
        if self.schedule is not None:
            dist.all_reduce(total, group=self._pp_group)  # only the last stage has the loss
        return total

    @property
    def _model(self) -> nn.Module:
        (model,) = self.model_parts  # without a pipeline schedule there is one part
        return model

    def _context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(tensor_parallel.loss_parallel_context(self.loss_parallel))
        stack.enter_context(self.autocast)
        return stack

    def _reduce_gradients(self, enabled: bool) -> None:
        for part in self.model_parts:
            if isinstance(part, FSDPModule):
                part.set_requires_gradient_sync(enabled)

    def _to_device(self, batch: Batch) -> Batch:
        inputs, labels = batch
        moved = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}
        return moved, labels.to(self.device, non_blocking=True)


def _keywords(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch's model inputs besides the tokens (``document_ids``, ``positions``)."""
    return {name: t for name, t in inputs.items() if name != "input"}

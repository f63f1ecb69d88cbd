"""This rank's model: the whole model built on meta in the run's dtype, cut into its pipeline
stages, parallelized by the family's plans, then given the seed's one-process weights.

The ``Trainer`` builds its model parts here; dry runs (``dry_run.py``) build their probes with
the same steps. Nothing here knows a model family: the ``ModelSpec`` does.
"""

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.components import lora
from torchtitan.components.optimizer import check_param_groups
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims, pipeline_split, precision
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.spec import ModelSpec, ParallelizeContext
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


class ModelBuilder:
    """The build steps of one family's model for one run (``config``) on ``device``."""

    def __init__(self, spec: ModelSpec, config: JobConfig, device: torch.device):
        self.spec, self.config, self.device = spec, config, device

    def flops_per_token(self, args: Any, lora_layers: list[nn.Module]) -> float:
        """Training FLOPs per token (the model's, or with ``--lora.rank`` its adapters' and the
        frozen weights' forward and input gradients: the frozen weights get no gradient)."""
        c = self.config
        flops = self.spec.flops_per_token(args, c.training.seq_len)
        if c.lora.rank > 0:
            # the whole model's adapters, whatever this rank holds
            adapters = sum(c.lora.rank * (m.in_features + m.out_features) for m in lora_layers)
            flops = lora.flops_per_token(flops, self.spec.flops_per_token(args, 0), adapters)
        return flops

    def meta_model(self, args: Any) -> nn.Module:
        """The whole model for ``args`` on the meta device, its parameters in
        ``--training.dtype``, before any parallelism."""
        with torch.device("meta"):
            model = self.spec.build_model(args)
        return precision.cast_parameters_(model, precision.param_dtype(self.config.training))

    def parts(
        self, args: Any, context: ParallelizeContext, *, pp_rank: int
    ) -> tuple[list[nn.Module], list["PipelineStage"]]:
        """The model for ``args`` on the meta device, parallelized by the model's plans: one
        part without pipeline parallelism; else pipeline rank ``pp_rank``'s stages, cut by the
        model's pipeline split, each parallelized, and their ``PipelineStage`` wrappers."""
        dims, p, t = context.parallel_dims, context.parallelism, context.training
        model = self.meta_model(args)
        if not dims.pp_enabled:
            return [self.spec.parallelize(model, context)], []
        layout = pipeline_split.pipeline_layout(p, args.n_layers)
        names = self.spec.pipeline(args, layout.num_stages, p)
        hidden_dtype, output_dtype = precision.pipeline_dtypes(dims, t)
        # Imported here: torch.distributed.pipelining loads dynamo (0.6 s of a rank's
        # start), which only pipelined runs need.
        from torchtitan.distributed import pipeline_parallel

        stages, parts = pipeline_parallel.build_stages(
            model,
            names,
            local_stages=layout.stages_by_rank[pp_rank],
            pp_mesh=dims.mesh("pp"),
            parallelize=lambda part: self.spec.parallelize(part, context),
            device=self.device,
            microbatch_size=p.pipeline_parallel_microbatch_size,
            seq_len=t.seq_len // dims.cp,
            hidden_dtype=hidden_dtype,
            output_dtype=output_dtype,
            tp_mesh=dims.mesh("tp") if dims.tp_enabled else None,
            sequence_parallel=p.enable_sequence_parallel,
            loss_parallel=not p.disable_loss_parallel,
        )
        return parts, stages

    def check_whole_model(self, args: Any) -> list[nn.Module]:
        """What needs the whole model (on meta), checked before any pipeline split or dry-run
        probe: ``--lora.target_modules`` that name no layer, ``--optimizer.param_groups``
        entries no trainable parameter takes. Returns the linear layers LoRA adapts."""
        c = self.config
        if c.lora.rank <= 0 and not c.optimizer.param_groups:
            return []
        with torch.device("meta"):
            model = self.spec.build_model(args)
            layers = list(lora.targets(model, c.lora).values()) if c.lora.rank > 0 else []
            check_param_groups(lora.add_adapters(model, c.lora), c.optimizer)
        return layers

    def log_parameters(self, model_parts: list[nn.Module], args: Any, dims: ParallelDims) -> None:
        """One line: the parameter count (the whole model's and this rank's stages'), and what
        LoRA trains."""
        named = [(n, p) for part in model_parts for n, p in part.named_parameters()]
        n_params = sum(p.numel() for _, p in named)
        c = self.config
        line = f"Model {c.model.name} {c.model.flavor}: {n_params:,} parameters"
        if dims.pp_enabled:  # this rank holds its stages: count the whole too
            with torch.device("meta"):
                whole = lora.add_adapters(self.spec.build_model(args), c.lora)
            total = sum(p.numel() for p in whole.parameters())
            line = f"Model {c.model.name} {c.model.flavor}: {total:,} parameters ({n_params:,} "
            line += "in this rank's pipeline stages)"
        if c.lora.rank > 0:
            adapters = lora.adapter_count(named)
            layers = sum(1 for part in model_parts for m in part.modules() if lora.is_adapted(m))
            line += (
                f", of which {adapters:,} train: LoRA rank {c.lora.rank} on {layers} linear "
                f"layers{' of this pipeline rank' if dims.pp_enabled else ''}"
            )
            if not (c.checkpoint.enable and c.checkpoint.initial_load_path):
                logger.warning(
                    "--lora.rank adapts a pretrained model, but no --checkpoint.initial_load_path "
                    "is given: unless a checkpoint is resumed, the frozen weights stay random"
                )
        logger.info(line)

    def init_weights(
        self, model_parts: list[nn.Module], args: Any, *, seed: int, stage_indices: list[int]
    ) -> None:
        """Materialise the model parts on the device with the seed's one-process weights."""

        def build_full() -> nn.Module:
            return lora.add_adapters(self.spec.build_model(args), self.config.lora)

        dist_utils.init_model_weights(
            model_parts,
            build_full,
            seed=seed,
            stage_indices=stage_indices or None,
            device=self.device,
            after_init=lora.init_adapters if self.config.lora.rank > 0 else None,
        )
        for part in model_parts:
            part.train()

"""float8 training of linear layers with torchao (``--float8.enable``).

A model's parallelize function calls :func:`apply_float8` first, on the unsharded model, so
tensor parallelism and FSDP then wrap torchao's ``Float8Linear`` modules like any linear: each
matmul casts its inputs to float8 (e4m3, scaled per tensor or per row by the recipe) and runs
``torch._scaled_mm``; weights, gradients and optimizer state stay in high precision.

On CPU this is the real path (torch 2.13 has ``_scaled_mm`` for e4m3 there) but slower than
bf16: the CPU has no float8 units. On CUDA it needs compute capability 8.9+ (H100, L40, 4090)
unless ``--float8.emulate``.

FSDP's float8 all-gather (tensorwise only) sends each weight's float8 bytes plus its scale.
gloo cannot move float8 tensors, but FSDP gathers a unit whose inputs mix dtypes (float8
weights with high-precision norms) as one byte buffer, which gloo moves: every unit of our
families mixes, and :func:`after_sharding` refuses, in one line, a unit that would not.
"""

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.execution import Compile
from torchtitan.config.job_config import Float8 as Float8Config
from torchtitan.config.job_config import Training
from torchtitan.distributed import ParallelDims, precision
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.tools.versions import torch_version

ALIGNMENT = 16
"""CUDA's float8 matmul needs both dims of a weight divisible by 16 (CPU does not; the same
filter keeps runs comparable across devices)."""


@functools.cache
def cpu_takes_row_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (torch 2.13 does; 2.11
    asserts that both scales are single numbers)."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn, device="cpu")
    rows, columns = torch.ones(16, 1, device="cpu"), torch.ones(1, 16, device="cpu")
    try:
        torch._scaled_mm(a, a.t(), scale_a=rows, scale_b=columns, out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def apply_to_model_part(
    model: nn.Module,
    config: Float8Config,
    training: Training,
    parallel_dims: ParallelDims,
    compile_config: Compile,
) -> None:
    """``--float8.*`` in a family's ``parallelize``, first (the parallel plans then wrap the
    float8 linears): :func:`apply_float8` with the run's autocast, and scalar CPU kernels
    where the blocks are compiled in bf16 (:func:`scalar_cpu_kernels`)."""
    apply_float8(model, config, autocast=precision.uses_autocast(parallel_dims, training))
    compiled = compile_config.enable and "model" in compile_config.components
    if compiled and precision.compute_dtype(training) == "bfloat16":
        scalar_cpu_kernels()


def apply_float8(model: nn.Module, config: Float8Config, *, autocast: bool) -> None:
    """Swap ``model``'s eligible ``nn.Linear`` modules for float8 ones, in place.
    ``autocast``: the run computes in bf16 through autocast (no casting FSDP policy)."""
    # torchao registers an enum with torch's pytree on import, which torch 2.13 warns about.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(
            "--float8.enable needs torchao: pip install 'torchao>=0.17,<0.19' (make setup "
            "installs it)"
        ) from None
    if torch.cuda.is_available() and not config.emulate:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"--float8.enable needs a GPU of compute capability 8.9+ (this one: "
                f"{major}.{minor}); pass --float8.emulate to check the numerics without speed"
            )
    if (
        config.recipe_name != "tensorwise"
        and not config.emulate
        and not torch.cuda.is_available()
        and not dist_utils.fake_collectives()  # a dry run estimates for GPUs too
        and not cpu_takes_row_scales()
    ):
        raise ConfigError(
            f"--float8.recipe_name {config.recipe_name}: torch {torch.__version__}'s CPU float8 "
            "matmul takes per-tensor scales only (row-wise needs torch >= 2.13 on CPU, or a "
            "GPU); use --float8.recipe_name tensorwise, or --float8.emulate for the numerics"
        )
    if config.recipe_name == "rowwise_with_gw_hp" and autocast:
        raise ConfigError(
            "--float8.recipe_name rowwise_with_gw_hp fails under bf16 autocast in torchao "
            "(its weight gradient mixes a bf16 and a float32 matrix); train in float32 "
            "(--training.mixed_precision_param float32) or under FSDP's mixed precision"
        )
    if config.recipe_name == "tensorwise":
        f8 = Float8LinearConfig(
            enable_fsdp_float8_all_gather=config.enable_fsdp_float8_all_gather,
            emulate=config.emulate,
        )
    else:
        f8 = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(config.recipe_name), emulate=config.emulate
        )
    before = _linears(model)
    convert_to_float8_training(
        model, config=f8, module_filter_fn=functools.partial(wanted, filter_fqns=config.filter_fqns)
    )
    converted = before - _linears(model)
    logger.info(
        f"float8 ({config.recipe_name}): {converted} of {before} linear layers converted "
        f"(kept in high precision: names containing {config.filter_fqns} and dims not "
        f"divisible by {ALIGNMENT})"
    )


def scalar_cpu_kernels() -> None:
    """Before compiling float8 linears that compute in bf16 (autocast or FSDP's casting): on
    CPU with torch >= 2.12, make inductor emit scalar C++ kernels. Its vectorized ones give NaN
    weight gradients when two float8 linears share a bf16 input (measured on torch 2.13: wq,
    wk, wv and w3 of every Llama 3 block from step 1; float32, eager, ``aot_eager``, torch
    2.11 and CUDA are fine; ``tests/unit_tests/components/test_float8.py`` has the smallest
    case). Slower, and float8 on CPU checks numerics, not speed."""
    if torch.cuda.is_available() or torch_version() < (2, 12):
        return
    import torch._inductor.config as inductor

    if inductor.cpp.simdlen != 0:
        inductor.cpp.simdlen = 0
        logger.warning(
            "float8 + compile in bf16 on CPU: compiling scalar kernels (torch "
            f"{torch.__version__}'s vectorized CPU kernels give NaN float8 weight gradients)"
        )


def wanted(module: nn.Module, fqn: str, *, filter_fqns: list[str]) -> bool:
    """Whether the linear ``module`` named ``fqn`` trains in float8."""
    if not isinstance(module, nn.Linear) or any(name in fqn for name in filter_fqns):
        return False
    return module.in_features % ALIGNMENT == 0 and module.out_features % ALIGNMENT == 0


def _linears(model: nn.Module) -> int:
    """Plain ``nn.Linear`` modules (torchao's float8 linear is a subclass of its own type)."""
    return sum(type(m) is nn.Linear for m in model.modules())


def after_sharding(model_parts: Sequence[nn.Module], optimizers: Any, config: Float8Config) -> None:
    """Once the parts are sharded and their optimizers built: check that gloo can gather every
    FSDP unit holding float8 weights and, with ``precompute_float8_dynamic_scale_for_fsdp``,
    compute the weights' scales before the first forward (after any checkpoint load) and after
    each optimizer step, one all-reduce per device mesh."""
    if not (config.enable and config.enable_fsdp_float8_all_gather):
        return
    units = [unit for part in model_parts for unit in _float8_units(part)]
    if not units:
        logger.warning(
            "--float8.enable_fsdp_float8_all_gather does nothing here: no FSDP unit holds "
            "float8 weights (FSDP2 is not sharding this layout)"
        )
        return
    for name, group, only_float8 in units:
        if only_float8 and _backend(group) == "gloo":
            raise ConfigError(
                f"--float8.enable_fsdp_float8_all_gather: the FSDP unit {name or 'model'!r} "
                f"holds only float8 weights, which gloo cannot gather; shard it with a "
                f"high-precision parameter (e.g. its block's norm) or remove the flag on CPU"
            )
    if config.precompute_float8_dynamic_scale_for_fsdp:
        optimizers.register_step_post_hook(lambda: precompute_scales(model_parts))
        # Before the first forward, so that step takes the same scales as every later one
        # (without it each all-gather reduces its weight's maximum over the FSDP ranks only,
        # which under TP is a shard's, not the weight's).
        for part in model_parts:
            _once_before_forward(part, functools.partial(precompute_scales, [part]))


def _once_before_forward(module: nn.Module, fn: Callable[[], object]) -> None:
    handles = []

    def hook(module: nn.Module, args: Any) -> None:
        handles.pop().remove()
        fn()

    handles.append(module.register_forward_pre_hook(hook, prepend=True))


def precompute_scales(model_parts: Sequence[nn.Module]) -> None:
    """Every float8 weight's scale from its current values, in one all-reduce per device mesh
    (torchao's precompute stacks the weights' maxima, which takes one mesh: under TP some
    weights are sharded over the data-parallel ranks only, others over data and TP ranks)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    by_mesh: dict[Any, list[nn.Module]] = {}
    for part in model_parts:
        for module in part.modules():
            weight = getattr(module, "weight", None)
            if is_float8(module) and float8_gathered(weight) and hasattr(weight, "device_mesh"):
                by_mesh.setdefault(weight.device_mesh, []).append(module)
    for linears in by_mesh.values():
        precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(linears))


def float8_gathered(param: torch.Tensor | None) -> bool:
    """Whether ``param`` is a weight FSDP would gather in float8 (torchao's wrapper, alone or
    inside a DTensor)."""
    local = getattr(param, "_local_tensor", param)
    return type(local).__name__ == "WeightWithDynamicFloat8CastTensor"


def _float8_units(model: nn.Module) -> list[tuple[str, Any, bool]]:
    """``(name, param group, whether it holds only float8 weights)`` of each FSDP2 unit of
    ``model`` holding float8 weights."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for name, module in model.named_modules():
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        group = getattr(state, "_fsdp_param_group", None) if state is not None else None
        if group is None or not group.fsdp_params:
            continue
        float8 = [float8_gathered(p.sharded_param) for p in group.fsdp_params]
        if any(float8):
            units.append((name, group, all(float8)))
    return units


def _backend(group: Any) -> str | None:
    process_group = getattr(group.mesh_info, "shard_process_group", None)
    return None if process_group is None else dist.get_backend(process_group)


def tp_in_float8(config: Float8Config, tp_mesh: Any, *, sequence_parallel: bool) -> bool:
    """Whether tensor parallelism moves float8 activations (torchao's float8 TP styles:
    ``tensorwise`` only). With sequence parallelism the styles all-gather float8 tensors,
    which gloo cannot move: there the activations cross ranks in high precision (the matmuls
    stay float8), said in one line."""
    if not (config.enable and config.recipe_name == "tensorwise"):
        return False
    if sequence_parallel and dist.get_backend(tp_mesh.get_group()) == "gloo":
        logger.info(
            "float8: tensor parallelism gathers activations in high precision on gloo (it "
            "cannot move float8 tensors); the matmuls are float8, NCCL gathers in float8"
        )
        return False
    return True


def tp_style(style: type, modules: Sequence[nn.Module], *, float8: bool, **kwargs: Any) -> Any:
    """``style(**kwargs)`` (``ColwiseParallel``, ``RowwiseParallel`` or
    ``PrepareModuleInput``), or torchao's float8 counterpart when ``float8`` and every module
    it feeds is a float8 linear (the input is then cast once, before any all-gather)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    if float8 and all(is_float8(module) for module in modules):
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        style = {
            ColwiseParallel: Float8ColwiseParallel,
            RowwiseParallel: Float8RowwiseParallel,
            PrepareModuleInput: PrepareFloat8ModuleInput,
        }[style]
    return style(**kwargs)


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is one of torchao's float8 linears."""
    # (a LoRA-adapted float8 linear is a subclass)
    mro = type(module).__mro__
    return nn.Linear in mro and any(cls.__name__ == "Float8Linear" for cls in mro)

"""ParallelDims: degree resolution, one-line errors, and the meshes it builds."""

import dataclasses

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import ParallelDims, ParallelDimsError
from torchtitan.models import llama3


def _dims(world_size: int, **degrees) -> ParallelDims:
    base = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1)
    return ParallelDims(**(base | degrees), world_size=world_size)


def test_dp_shard_minus_one_takes_what_is_left():
    dims = _dims(16, dp_replicate=2, tp=2)
    assert dims.dp_shard == 4 and dims.dp_degree == 8 and dims.non_data_parallel_size == 2
    assert dims.fsdp_enabled and dims.dp_replicate_enabled and dims.tp_enabled
    assert not (dims.cp_enabled or dims.pp_enabled or dims.ep_enabled)


@pytest.mark.parametrize(
    ("world", "degrees", "message"),
    [
        (2, {"dp_replicate": 3}, "world size 2 is not divisible by dp_replicate x cp x tp x pp"),
        (8, {"dp_shard": 2, "tp": 2}, "= 4 != world size 8"),
        (8, {"dp_shard": 2, "tp": 2}, "NGPU=4"),
        (4, {"tp": 0}, "--parallelism.tensor_parallel_degree=0 must be >= 1"),
        (4, {"pp": -1}, "--parallelism.pipeline_parallel_degree=-1 must be >= 1"),
        (4, {"cp": 0}, "--parallelism.context_parallel_degree=0 must be >= 1"),
        (4, {"dp_replicate": 0}, "--parallelism.data_parallel_replicate_degree=0 must be >= 1"),
        (4, {"dp_shard": -2}, "--parallelism.data_parallel_shard_degree=-2 must be -1"),
        (4, {"dp_shard": 0}, "--parallelism.data_parallel_shard_degree=0 must be -1"),
        (4, {"ep": 3}, "--parallelism.expert_parallel_degree=3 must divide dp_shard x cp x tp"),
        (
            8,
            {"cp": 2, "ep": 16},
            "expert_parallel_degree=16 must divide dp_shard x cp x tp = 4 x 2",
        ),
        (8, {"tp": 4, "ep": 2}, "tensor_parallel_degree=4: expert parallelism spans the TP ranks"),
    ],
)
def test_bad_degrees_are_one_line_errors_naming_the_flag(world, degrees, message):
    with pytest.raises(ParallelDimsError, match=message.replace("(", r"\(")) as error:
        _dims(world, **degrees)
    assert "\n" not in str(error.value)
    assert isinstance(error.value, ConfigError)


def _llama_config(flavor: str, **training) -> JobConfig:
    config = llama3.config_registry.llama3_debugmodel()
    config.model.flavor = flavor
    config.training = dataclasses.replace(config.training, **training)
    return config


@pytest.mark.parametrize(
    ("flavor", "tp", "seq_len", "message"),
    [
        ("debugmodel", 3, 512, "tensor_parallel_degree=3 does not divide n_heads=16"),
        ("8B", 16, 8192, "tensor_parallel_degree=16 does not divide n_kv_heads=8"),
        ("debugmodel", 2, 63, "does not divide --training.seq_len=63"),
        ("debugmodel", 32, 512, "does not divide n_heads=16"),
    ],
)
def test_degrees_that_do_not_split_the_model_are_rejected(flavor, tp, seq_len, message):
    config = _llama_config(flavor, seq_len=seq_len)
    with pytest.raises(ConfigError, match=message):
        llama3.validate(config, _dims(tp, tp=tp))


def test_tp_that_splits_everything_passes():
    llama3.validate(_llama_config("70B", seq_len=8192), _dims(64, tp=8))


def test_build_mesh_names_and_flattened_dims():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    try:
        dims = _dims(16, dp_replicate=2, dp_shard=2, tp=2, pp=2)
        mesh = dims.build_mesh("cpu")
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert mesh.shape == (2, 2, 2, 1, 2)
        sizes = {name: mesh[name].size() for name in ("dp", "dp_shard_cp", "dp_cp", "tp", "pp")}
        assert sizes == {"dp": 4, "dp_shard_cp": 2, "dp_cp": 4, "tp": 2, "pp": 2}
        # TP ranks are neighbours (innermost dimension).
        assert mesh["tp"].mesh.tolist() == [0, 1]
        # Each slice is built once: the same object every time it is asked for.
        assert dims.mesh("tp") is dims.mesh("tp")
        assert dims.mesh("dp_replicate", "dp_shard_cp") is dims.mesh("dp_replicate", "dp_shard_cp")
        assert dims.mesh("dp_replicate", "dp_shard_cp").mesh_dim_names == (
            "dp_replicate",
            "dp_shard",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("degrees", "ep_ranks", "efsdp_ranks", "ep_data_parallel"),
    [
        # EP inside dp_shard: rank 0's expert group is its dp_shard neighbours.
        ({"dp_shard": 8, "ep": 2}, [0, 1], [0, 2, 4, 6], 2),
        # With TP, EP takes the TP ranks first (innermost), then dp_shard ranks.
        ({"dp_shard": 4, "tp": 2, "ep": 4}, [0, 1, 2, 3], [0, 4], 2),
        ({"dp_shard": 2, "tp": 2, "ep": 2, "dp_replicate": 2}, [0, 1], [0, 2], 1),
        # EP borrows CP ranks (innermost after TP), then dp_shard ranks.
        ({"dp_shard": 2, "cp": 4, "ep": 2}, [0, 1], [0, 2, 4, 6], 2),
        ({"dp_shard": 4, "cp": 2, "ep": 4}, [0, 1, 2, 3], [0, 4], 4),
        ({"dp_shard": 2, "cp": 2, "tp": 2, "ep": 8}, list(range(8)), [0], 4),
    ],
)
def test_expert_meshes_split_dp_shard_and_take_tp_ranks_first(
    degrees, ep_ranks, efsdp_ranks, ep_data_parallel
):
    world = 8
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        dims = _dims(world, **degrees)
        dims.build_mesh("cpu")
        assert dims.mesh("ep").mesh.tolist() == ep_ranks
        assert dims.mesh("efsdp").mesh.tolist() == efsdp_ranks
        assert dims.ep_data_parallel == ep_data_parallel
        if dims.dp_replicate > 1:
            assert dims.mesh("dp_replicate", "efsdp").shape == (2, len(efsdp_ranks))
    finally:
        dist.destroy_process_group()

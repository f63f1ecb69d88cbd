"""The pipeline simulation of COMM_MODE=local_tensor: one thread per pipeline rank, its
point-to-point messages and pp all-reductions between threads, failures and deadlocks."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed import local_pipeline, local_tensor

# 4 simulated ranks, pp 2 outermost: pipeline rank 0 simulates ranks 0, 1 and pipeline
# rank 1 ranks 2, 3; the pp groups are {0, 2} and {1, 3}, the dp groups {0, 1} and {2, 3}.
WORLD, PP = 4, 2


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


def _per_rank(make) -> torch.Tensor:
    return enabled_local_tensor_mode().rank_map(make)


def _values(t: torch.Tensor, ranks) -> dict[int, list[float]]:
    return {r: local_tensor.value_on_rank(t, r).tolist() for r in ranks}


def test_messages_keep_their_order_and_pp_reductions_cross_threads(fake_world):
    seen = {}

    def job(pp_rank: int) -> None:
        mesh = init_device_mesh("cpu", (PP, WORLD // PP), mesh_dim_names=("pp", "dp"))
        pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        mine = range(pp_rank * 2, pp_rank * 2 + 2)
        seen[pp_rank, "rank"] = dist.get_rank(pp_group)
        seen[pp_rank, "first"] = local_tensor.own_rank()
        if pp_rank == 0:
            x = _per_rank(lambda r: torch.full((2,), float(r)))
            dist.isend(x, group=pp_group, group_dst=1)
            dist.send(x * 10, group=pp_group, group_dst=1)
        else:
            first, second = torch.zeros(2), torch.zeros(2)
            w1 = dist.irecv(first, group=pp_group, group_src=0)
            w2 = dist.irecv(second, group=pp_group, group_src=0)
            w2.wait()  # completes w1 first: messages from one rank arrive in order
            assert w1.is_completed()
            seen["first"], seen["second"] = _values(first, mine), _values(second, mine)
        total = _per_rank(lambda r: torch.tensor(float(r)))
        dist.all_reduce(total, group=pp_group)
        seen[pp_rank, "pp_sum"] = _values(total, mine)
        within = _per_rank(lambda r: torch.tensor(float(r)))
        dist.all_reduce(within, group=dp_group)  # inside the thread's ranks: the mode's own
        seen[pp_rank, "dp_sum"] = _values(within, mine)

    local_pipeline.run(WORLD, PP, job)

    assert seen[0, "rank"] == 0 and seen[1, "rank"] == 1
    assert seen[0, "first"] == 0 and seen[1, "first"] == 2
    # Rank 2 receives from its pp peer rank 0, rank 3 from rank 1.
    assert seen["first"] == {2: [0.0, 0.0], 3: [1.0, 1.0]}
    assert seen["second"] == {2: [0.0, 0.0], 3: [10.0, 10.0]}
    assert seen[0, "pp_sum"] == {0: 2.0, 1: 4.0} and seen[1, "pp_sum"] == {2: 2.0, 3: 4.0}
    assert seen[0, "dp_sum"] == {0: 1.0, 1: 1.0} and seen[1, "dp_sum"] == {2: 5.0, 3: 5.0}
    assert local_pipeline.first_rank() is None  # outside the simulation


def test_a_failing_pipeline_rank_ends_the_others(fake_world):
    def job(pp_rank: int) -> None:
        mesh = init_device_mesh("cpu", (PP, WORLD // PP), mesh_dim_names=("pp", "dp"))
        if pp_rank == 0:
            raise ValueError("stage 0 is broken")
        dist.recv(torch.zeros(1), group=mesh["pp"].get_group(), group_src=0)  # never sent

    with pytest.raises(ValueError, match="stage 0 is broken"):
        local_pipeline.run(WORLD, PP, job)


def test_a_schedule_that_cannot_complete_is_reported_not_hung(fake_world):
    def job(pp_rank: int) -> None:
        mesh = init_device_mesh("cpu", (PP, WORLD // PP), mesh_dim_names=("pp", "dp"))
        dist.recv(torch.zeros(1), group=mesh["pp"].get_group(), group_src=1 - pp_rank)

    with pytest.raises(local_pipeline.PipelineSimulationError, match="every pipeline rank waits"):
        local_pipeline.run(WORLD, PP, job)


def test_traffic_over_a_group_that_is_not_pp_is_refused(fake_world):
    def job(pp_rank: int) -> None:
        init_device_mesh("cpu", (PP, WORLD // PP), mesh_dim_names=("pp", "dp"))
        everyone = _per_rank(lambda r: torch.tensor(1.0))
        dist.all_reduce(everyone)  # the world group spans both pipeline ranks

    with pytest.raises(local_pipeline.PipelineSimulationError, match="only over the pp group"):
        local_pipeline.run(WORLD, PP, job)


def test_objects_are_gathered_across_threads_over_pp_and_the_world(fake_world):
    seen = {}

    def job(pp_rank: int) -> None:
        mesh = init_device_mesh("cpu", (PP, WORLD // PP), mesh_dim_names=("pp", "dp"))
        mine = {"stage": pp_rank}
        over_pp, over_world = [None] * PP, [None] * WORLD
        dist.all_gather_object(over_pp, mine, group=mesh["pp"].get_group())
        dist.all_gather_object(over_world, mine)  # e.g. a checkpoint's verification
        mine["stage"] = -1  # the others hold copies
        seen[pp_rank] = over_pp, over_world

    local_pipeline.run(WORLD, PP, job)
    for pp_rank in range(PP):
        over_pp, over_world = seen[pp_rank]
        # The other stage's object, unchanged by its later edit (a copy, as pickling makes).
        assert over_pp[1 - pp_rank] == {"stage": 1 - pp_rank}
        # Each rank's slot holds the object of the thread simulating it (ranks 2, 3: stage 1).
        others = [o for r, o in enumerate(over_world) if r // 2 != pp_rank]
        assert others == [{"stage": 1 - pp_rank}] * 2


def test_a_tensor_met_where_a_gathered_object_is_expected_is_an_error(fake_world):
    def job(pp_rank: int) -> None:
        mesh = init_device_mesh("cpu", (PP, WORLD // PP), mesh_dim_names=("pp", "dp"))
        if pp_rank == 0:
            dist.send(torch.zeros(1), group=mesh["pp"].get_group(), group_dst=1)
        dist.all_gather_object([None] * PP, pp_rank, group=mesh["pp"].get_group())

    with pytest.raises(local_pipeline.PipelineSimulationError, match="collectives disagree"):
        local_pipeline.run(WORLD, PP, job)

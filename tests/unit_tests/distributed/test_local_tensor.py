"""The single-process rank simulation (``COMM_MODE=local_tensor``) itself."""

from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed import local_tensor


def _per_rank(value) -> list[int]:
    """A simulated rank-dependent int (``SymInt`` over a ``LocalIntNode``) as a list by rank."""
    ints = value.node._local_ints
    return [int(ints[r]) for r in sorted(ints)]


def test_a_new_mesh_at_a_dead_meshs_address_gets_its_own_coordinates():
    # torch 2.11-2.13 cache each mesh's coordinates under id(mesh) (pytorch/pytorch#184526):
    # a mesh built where a dead one lived got the dead one's coordinates, so a "b" slice could
    # answer with the coordinates of an "a" slice. In the trainer this sent the vocabulary
    # shards of the EP x TP embedding gradient to the wrong ranks, in rare processes.
    dead_ids, reused, wrong = set(), 0, []
    with local_tensor.local_tensor_mode(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        for _ in range(100):
            a = mesh["a"]  # a new object each time, dropped at once
            reused += id(a) in dead_ids
            if (got := _per_rank(a.get_local_rank())) != [0, 0, 1, 1]:
                wrong.append(("a", got))
            dead_ids.add(id(a))
            del a
            b = mesh["b"]
            reused += id(b) in dead_ids
            if (got := _per_rank(b.get_local_rank())) != [0, 1, 0, 1]:
                wrong.append(("b", got))
            dead_ids.add(id(b))
            del b
    # The situation arose (a new mesh at a dead mesh's address), and it did no harm.
    assert reused > 0, "no mesh reused a dead mesh's address: the test proves nothing here"
    assert wrong == [], f"{len(wrong)} of 200 slices got another mesh's coordinates"


def test_the_guard_wraps_torch_once_however_many_simulations_run():
    from torch.distributed import _local_tensor

    with local_tensor.local_tensor_mode(2):
        guarded = _local_tensor._LocalDeviceMesh.get_coordinate
        assert getattr(guarded, "_torchtitan_guarded", False)
    with local_tensor.local_tensor_mode(2):
        assert _local_tensor._LocalDeviceMesh.get_coordinate is guarded

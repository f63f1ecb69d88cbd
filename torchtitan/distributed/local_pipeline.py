"""``COMM_MODE=local_tensor`` with pipeline parallelism: one thread per pipeline rank.

``LocalTensorMode`` simulates one program on many ranks (SPMD). A pipeline runs a different
program on each pipeline rank (its own stages, its own schedule actions), so one mode cannot
hold it. Here the whole run is started once per pipeline rank, each in its own thread under
its own ``LocalTensorMode`` over the ranks of that pipeline coordinate: with ``S = world /
pp`` ranks per coordinate (``pp`` is the outermost mesh dimension), thread ``i`` simulates
ranks ``i*S .. (i+1)*S - 1``. Inside a thread the collectives of data, tensor and context
parallelism run as in the SPMD simulation. What crosses threads is the pipeline's own traffic:

- point-to-point sends and receives over the ``pp`` group (the stages' activations and
  gradients), ``dist.isend/irecv/send/recv/batch_isend_irecv``;
- all-reductions over the ``pp`` group (the logged loss, the gradient norm),
  ``dist.all_reduce``;
- gathers of Python objects over groups spanning pipeline coordinates (each stage's MoE
  metrics over ``pp``, a checkpoint's verification over the world), ``dist.all_gather_object``.

Those functions are replaced while the simulation runs: a message from rank ``r`` to its peer
``r'`` goes into the queue ``(r, r')`` and is taken out, in order, by the receiving thread.
Any other collective whose group spans several pipeline coordinates would be skipped silently
by ``LocalTensorMode``; the replaced ``all_reduce`` refuses one that is not a ``pp`` group.

Only one thread runs at a time (a lock, like torch's ``LocalRunnerMode``); a thread that waits
for a message lets another run, so the interleaving, and every number, is deterministic. When
every thread waits and no message can arrive (a schedule that cannot complete), or when one
thread fails, the others stop with an error instead of hanging.

Relies on private torch pieces (``torch.distributed._local_tensor``, torch 2.13): the mode
list per thread (``_PROCESS_MODE``) and the names the mode patches into ``DeviceMesh`` and
``torch.random``. The mode patches them process-wide; this runner re-applies the running
thread's state each time a thread resumes.
"""

import collections
import copy
import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed import _local_tensor as lt
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.distributed import local_tensor
from torchtitan.tools.logging import logger

_REPLACED = (
    "isend",
    "irecv",
    "send",
    "recv",
    "batch_isend_irecv",
    "all_reduce",
    "all_gather_object",
    "get_rank",
)


class PipelineSimulationError(RuntimeError):
    """The simulated pipeline cannot go on (every pipeline rank waits, or another failed)."""


class _Stopped(Exception):
    """Ends a thread because another one failed (not reported itself)."""


class PipelineSimulation:
    """Runs ``fn(pipeline_rank)`` once per pipeline rank, each in a thread simulating the
    ranks of that pipeline coordinate. Use :func:`run`."""

    def __init__(self, world_size: int, pp_degree: int):
        if world_size % pp_degree:
            raise ValueError(f"world size {world_size} is not a multiple of pp {pp_degree}")
        self.world_size, self.pp = world_size, pp_degree
        self.stride = world_size // pp_degree
        self._cond = threading.Condition()
        self._queues: dict[tuple[int, int], collections.deque] = collections.defaultdict(
            collections.deque
        )
        self._waiting: dict[int, tuple[int, int]] = {}  # pipeline rank -> queue it waits on
        self._alive = 0
        self._failure: BaseException | None = None
        self._thread = threading.local()  # .pp_rank, .pending (peer -> posted receives)

    # ---- layout ----------------------------------------------------------------------------

    def ranks(self, pp_rank: int) -> range:
        """The global ranks simulated by pipeline rank ``pp_rank``'s thread."""
        return range(pp_rank * self.stride, (pp_rank + 1) * self.stride)

    def peer(self, rank: int, pp_rank: int) -> int:
        """The rank at pipeline coordinate ``pp_rank`` in ``rank``'s ``pp`` group."""
        return rank % self.stride + pp_rank * self.stride

    @property
    def pp_rank(self) -> int:
        return self._thread.pp_rank

    # ---- running ---------------------------------------------------------------------------

    def run(self, fn: Callable[[int], None]) -> None:
        """``fn(pp_rank)`` in one thread per pipeline rank; returns when all are done and
        raises the first failure."""
        originals = _Patches.take()
        replaced = {name: getattr(self, f"_{name}") for name in _REPLACED}
        saved = {(m, n): getattr(m, n) for m in (dist, c10d) for n in _REPLACED}
        process_mode, lt._PROCESS_MODE = lt._PROCESS_MODE, False  # a mode stack per thread
        quiet = _OtherStagesQuiet(self)
        logger.addFilter(quiet)
        for module in (dist, c10d):
            for name, value in replaced.items():
                setattr(module, name, value)
        self._alive = self.pp
        threads = [
            threading.Thread(target=self._main, args=(i, fn, originals), name=f"pp{i}", daemon=True)
            for i in range(self.pp)
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for (module, name), value in saved.items():
                setattr(module, name, value)
            lt._PROCESS_MODE = process_mode
            logger.removeFilter(quiet)
            originals.apply(enabled=False)
        if self._failure is not None:
            raise self._failure
        left = {key: len(q) for key, q in self._queues.items() if q}
        if left:
            raise PipelineSimulationError(
                "COMM_MODE=local_tensor: the run ended with messages nobody received "
                f"(sender -> receiver: count) {left}; the pipeline ranks' schedules disagree"
            )

    def _main(self, pp_rank: int, fn: Callable[[int], None], originals: "_Patches") -> None:
        self._thread.pp_rank = pp_rank
        self._thread.pending = collections.defaultdict(collections.deque)
        self._thread.originals = originals
        with self._cond:  # one thread at a time: released only while waiting for a message
            try:
                if self._failure is not None:  # another pipeline rank failed before this began
                    raise _Stopped()
                with local_tensor.simulation_mode(frozenset(self.ranks(pp_rank))) as mode:
                    # What the mode restores when paused: the real functions, whatever
                    # another thread's mode had patched in when this one started.
                    originals.own_by(mode)
                    originals.apply(enabled=True)
                    fn(pp_rank)
            except _Stopped:
                pass
            except BaseException as e:
                if self._failure is None:
                    self._failure = e
            finally:
                self._alive -= 1
                self._cond.notify_all()

    def _resume(self) -> None:
        """Give the process-wide patches the state of the thread that runs now."""
        self._thread.originals.apply(enabled=lt.enabled_local_tensor_mode() is not None)

    # ---- messages --------------------------------------------------------------------------

    def _put(self, src: int, dst: int, value: torch.Tensor) -> None:
        self._queues[(src, dst)].append(value)
        self._cond.notify_all()

    def _take(self, src: int, dst: int) -> torch.Tensor:
        """The next message from ``src`` to ``dst``; waits (letting other threads run)."""
        key = (src, dst)
        while not self._queues[key]:
            if self._failure is not None:
                raise _Stopped()
            self._waiting[self.pp_rank] = key
            try:
                if len(self._waiting) == self._alive and not any(
                    self._queues[k] for k in self._waiting.values()
                ):
                    self._failure = PipelineSimulationError(
                        "COMM_MODE=local_tensor: every pipeline rank waits for a message that "
                        f"no rank will send (pipeline rank {self.pp_rank} waits for rank "
                        f"{src} -> {dst}); the schedule cannot complete"
                    )
                    self._cond.notify_all()
                    raise _Stopped()
                self._cond.wait()
            finally:
                del self._waiting[self.pp_rank]
            self._resume()
        return self._queues[key].popleft()

    def _take_tensor(self, src: int, dst: int) -> torch.Tensor:
        value = self._take(src, dst)
        if isinstance(value, _Object):
            raise PipelineSimulationError(
                f"rank {dst} expected a tensor from rank {src} and got a gathered object: the "
                "pipeline ranks' collectives disagree"
            )
        return value

    def _send_to(self, peer_pp: int, tensor: torch.Tensor) -> None:
        values = _per_rank(tensor, self.ranks(self.pp_rank))
        for rank in self.ranks(self.pp_rank):
            self._put(rank, self.peer(rank, peer_pp), values[rank].detach().clone())

    def _receive_into(self, peer_pp: int, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        for rank in self.ranks(self.pp_rank):
            value = self._take_tensor(self.peer(rank, peer_pp), rank)
            target = tensor._local_tensors[rank] if isinstance(tensor, lt.LocalTensor) else tensor
            target.copy_(value)

    def _peer_pp(self, group: Any, peer: int | None, group_peer: int | None) -> int:
        group = c10d._group_or_default_group(group)
        ranks = dist.get_process_group_ranks(group)
        if not self._is_pp_group(ranks):
            raise PipelineSimulationError(
                f"COMM_MODE=local_tensor with pipeline parallelism: point-to-point traffic "
                f"only over the pp group, not over ranks {ranks}"
            )
        return group_peer if group_peer is not None else ranks.index(peer)

    # ---- the replaced torch.distributed functions ------------------------------------------

    def _get_rank(self, group=None):
        """In a ``pp`` group, this thread's pipeline coordinate (the same on all its ranks);
        elsewhere what the fake group says (rank 0's view)."""
        if group is not None and lt.enabled_local_tensor_mode() is not None:
            ranks = dist.get_process_group_ranks(group)
            if self._is_pp_group(ranks):
                return self.pp_rank
        return _SAVED_GET_RANK(group)

    def _is_pp_group(self, ranks: list[int]) -> bool:
        return len(ranks) == self.pp and all(
            r % self.stride == ranks[0] % self.stride and r // self.stride == i
            for i, r in enumerate(ranks)
        )

    def _isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self._send_to(self._peer_pp(group, dst, group_dst), tensor)
        return _Done()

    def _irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        peer_pp = self._peer_pp(group, src, group_src)
        work = _Receive(self, peer_pp, tensor)
        self._thread.pending[peer_pp].append(work)
        return work

    def _send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self._isend(tensor, dst, group, tag, group_dst)

    def _recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self._irecv(tensor, src, group, tag, group_src).wait()
        return src if src is not None else group_src

    def _batch_isend_irecv(self, p2p_op_list):
        return [
            (self._isend if op.op == self._isend else self._irecv)(
                op.tensor, None, op.group, op.tag, op.group_peer
            )
            for op in p2p_op_list
        ]

    def _all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        """Sum or max over the ``pp`` group: every thread sends its ranks' values to the other
        pipeline ranks and combines all of them in pipeline order (the same result on every
        rank). Groups within this thread's ranks go to ``LocalTensorMode`` as usual."""
        group = c10d._group_or_default_group(group)
        ranks = dist.get_process_group_ranks(group)
        # A group within one pipeline coordinate (this one's, or rank 0's of the fake
        # process group: the mode applies it to every group of the same shape).
        if lt.enabled_local_tensor_mode() is None or len({r // self.stride for r in ranks}) == 1:
            return _SAVED_ALL_REDUCE(tensor, op=op, group=group, async_op=async_op)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            raise PipelineSimulationError(f"all_reduce {op} over the pp group is not simulated")
        self._peer_pp(group, ranks[0], None)  # a pp group, or refuse
        if any(self._thread.pending[p] for p in range(self.pp)):
            raise PipelineSimulationError("all_reduce over pp while receives are still posted")
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        # Copies: with a plain tensor every rank's value is the same object, updated below.
        mine = {r: v.clone() for r, v in _per_rank(tensor, self.ranks(self.pp_rank)).items()}
        for peer_pp in range(self.pp):
            if peer_pp != self.pp_rank:
                self._send_to(peer_pp, tensor)
        for rank in self.ranks(self.pp_rank):
            values = [
                mine[rank] if p == self.pp_rank else self._take_tensor(self.peer(rank, p), rank)
                for p in range(self.pp)
            ]
            total = values[0].clone()
            for v in values[1:]:
                total = total + v if op == dist.ReduceOp.SUM else torch.maximum(total, v)
            target = tensor._local_tensors[rank] if isinstance(tensor, lt.LocalTensor) else tensor
            target.copy_(total)
        return _Done() if async_op else None

    def _all_gather_object(self, object_list, obj, group=None):
        """Over a group that spans pipeline coordinates (the ``pp`` group: each stage's MoE
        metrics; the world: a checkpoint's verification): each thread sends a copy of its
        object (its ranks' common view) once to every other thread of the group, and every
        rank's slot gets the object of the thread simulating that rank. Groups within one
        thread's ranks as without threads."""
        group = c10d._group_or_default_group(group)
        ranks = dist.get_process_group_ranks(group)
        threads = sorted({r // self.stride for r in ranks})
        if lt.enabled_local_tensor_mode() is None or len(threads) == 1:
            return _SAVED_ALL_GATHER_OBJECT(object_list, obj, group=group)
        if any(self._thread.pending[p] for p in range(self.pp)):
            raise PipelineSimulationError(
                "all_gather_object across threads while receives are posted"
            )
        first = self.ranks(self.pp_rank)[0]  # one message per pair of threads
        for peer_pp in threads:
            if peer_pp != self.pp_rank:
                self._put(first, peer_pp * self.stride, _Object(copy.deepcopy(obj)))
        objects = {self.pp_rank: obj}
        for peer_pp in threads:
            if peer_pp != self.pp_rank:
                message = self._take(peer_pp * self.stride, first)
                if not isinstance(message, _Object):
                    raise PipelineSimulationError(
                        f"all_gather_object on pipeline rank {self.pp_rank} received a tensor "
                        f"from pipeline rank {peer_pp}: the ranks' collectives disagree"
                    )
                objects[peer_pp] = message.value
        for i, rank in enumerate(ranks):
            object_list[i] = objects[rank // self.stride]


class _Object:
    """A Python object in a message queue (told apart from the tensors of sends)."""

    def __init__(self, value: Any):
        self.value = value


# Bound before the simulation replaces them.
_SAVED_ALL_REDUCE = dist.all_reduce
_SAVED_ALL_GATHER_OBJECT = dist.all_gather_object
_SAVED_GET_RANK = dist.get_rank


def _per_rank(tensor: torch.Tensor, ranks: range) -> dict[int, torch.Tensor]:
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    if isinstance(tensor, lt.LocalTensor):
        return {r: tensor._local_tensors[r] for r in ranks}
    return {r: tensor for r in ranks}


class _Done:
    """The work of a send: delivered at once."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Receive:
    """A posted receive; ``wait()`` completes it and, first, every receive posted before it
    from the same pipeline rank (messages between two ranks arrive in order)."""

    def __init__(self, sim: PipelineSimulation, peer_pp: int, tensor: torch.Tensor):
        self.sim, self.peer_pp, self.tensor, self.done = sim, peer_pp, tensor, False

    def wait(self, timeout: Any = None) -> bool:
        pending = self.sim._thread.pending[self.peer_pp]
        while not self.done:
            work = pending.popleft()
            self.sim._receive_into(work.peer_pp, work.tensor)
            work.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class _Patches:
    """The functions ``LocalTensorMode`` patches process-wide (``DeviceMesh`` methods, torch's
    seeding), as they were before any mode."""

    def __init__(self, mesh: dict[str, Any], random: dict[str, Any]):
        self.mesh, self.random = mesh, random

    @classmethod
    def take(cls) -> "_Patches":
        mesh = {name: getattr(DeviceMesh, name) for name in lt._PATCHED_DEVICE_MESH_METHODS}
        random = {}
        for global_name, _ in lt._PATCHED_RANDOM_FUNCTIONS:
            module, attr = global_name.rsplit(".", 1)
            random[global_name] = getattr(importlib.import_module(module), attr)
        return cls(mesh, random)

    def own_by(self, mode: lt.LocalTensorMode) -> None:
        mode._old_device_mesh_methods = dict(self.mesh)
        mode._old_random_functions = dict(self.random)

    def apply(self, *, enabled: bool) -> None:
        for name, original in self.mesh.items():
            setattr(DeviceMesh, name, getattr(lt._LocalDeviceMesh, name) if enabled else original)
        for global_name, local_name in lt._PATCHED_RANDOM_FUNCTIONS:
            module, attr = global_name.rsplit(".", 1)
            value = getattr(lt._LocalRandom, local_name) if enabled else self.random[global_name]
            setattr(importlib.import_module(module), attr, value)


class _OtherStagesQuiet(logging.Filter):
    """Only pipeline rank 0's thread (which simulates rank 0) logs below ERROR: the other
    threads run the same trainer and would repeat every line."""

    def __init__(self, sim: PipelineSimulation):
        super().__init__()
        self.sim = sim

    def filter(self, record: logging.LogRecord) -> bool:
        pp_rank = getattr(self.sim._thread, "pp_rank", 0)
        return pp_rank == 0 or record.levelno >= logging.ERROR


_current: PipelineSimulation | None = None


def run(world_size: int, pp_degree: int, fn: Callable[[int], None]) -> None:
    """Simulate ``world_size`` ranks with ``pp_degree`` pipeline ranks: ``fn(pp_rank)`` runs
    the whole job of one pipeline coordinate (see the module doc)."""
    global _current
    if not hasattr(lt, "_PROCESS_MODE") or not hasattr(lt, "_LocalDeviceMesh"):
        raise RuntimeError(
            "COMM_MODE=local_tensor with pipeline parallelism needs torch >= 2.13 "
            f"(this is {torch.__version__}); run the pipeline with real ranks"
        )
    _current = PipelineSimulation(world_size, pp_degree)
    try:
        _current.run(fn)
    finally:
        _current = None


def first_rank() -> int | None:
    """Under the pipeline simulation, the first rank this thread simulates (its "own" rank,
    whose view it logs); else ``None``."""
    sim = _current
    if sim is None or not hasattr(sim._thread, "pp_rank"):
        return None
    return sim.ranks(sim.pp_rank)[0]

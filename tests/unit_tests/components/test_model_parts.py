"""Model parts (pipeline stages) are consumed as one model: optimizer and model state merge
under the whole model's names, and the gradient norm is global across pipeline ranks."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchtitan.components.checkpoint_states import ModelState
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.config.job_config import LRScheduler, Optimizer
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_


class Whole(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 3)
        self.last = nn.Linear(3, 2)

    def forward(self, x):
        return self.last(self.first(x))


def _split(whole: Whole) -> list[nn.Module]:
    """Two stages holding the same parameter objects under the whole model's names."""
    first, last = nn.Module(), nn.Module()
    first.first, last.last = whole.first, whole.last
    return [first, last]


def _train_one_step(parts: list[nn.Module], whole: Whole):
    optimizers = build_optimizers(parts, Optimizer(lr=0.1), torch.device("cpu"))
    schedulers = build_lr_schedulers(optimizers, LRScheduler(warmup_steps=2), training_steps=4)
    whole(torch.ones(5, 4)).pow(2).sum().backward()
    optimizers.step()
    schedulers.step()
    return optimizers, schedulers


def test_parts_save_what_the_whole_model_saves_and_load_into_it():
    torch.manual_seed(0)
    split = Whole()
    whole = Whole()
    whole.load_state_dict(split.state_dict())
    split_optim, split_sched = _train_one_step(_split(split), split)
    whole_optim, whole_sched = _train_one_step([whole], whole)

    saved = split_optim.state_dict()
    expected = whole_optim.state_dict()
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(torch.as_tensor(saved[key]), torch.as_tensor(value)), key
    assert ModelState(_split(split)).state_dict().keys() == ModelState([whole]).state_dict().keys()
    assert split_sched.state_dict() == whole_sched.state_dict()

    # The stages' checkpoint resumes one process exactly (and the reverse split).
    fresh = Whole()
    fresh_optim, fresh_sched = _train_one_step([fresh], fresh)
    ModelState([fresh]).load_state_dict(ModelState(_split(split)).state_dict())
    fresh_optim.load_state_dict(copy.deepcopy(saved))  # as read from disk: no shared tensors
    fresh_sched.load_state_dict(split_sched.state_dict())
    for opt in (fresh_optim, split_optim):
        opt.zero_grad()
    for model in (fresh, split):
        model(torch.ones(5, 4)).sum().backward()
    fresh_optim.step()
    split_optim.step()
    for (name, p), q in zip(fresh.named_parameters(), split.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert fresh_sched.get_last_lr() == split_sched.get_last_lr()


def _pp_rank(rank: int, world: int, init_file: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dims = ParallelDims(1, 1, 1, 1, world, 1, world_size=world)
        dims.build_mesh("cpu")
        # Stage r holds one parameter with gradient (r + 1) * [1, 2].
        param = nn.Parameter(torch.zeros(2))
        param.grad = (rank + 1) * torch.tensor([1.0, 2.0])
        norm = clip_grad_norm_([param], max_norm=1.0, pp_mesh=dims.mesh("pp"))
        queue.put((rank, norm.item(), param.grad.tolist()))
    finally:
        dist.destroy_process_group()
    # gloo can abort a rank at interpreter exit after a clean shutdown (TORCH_ON_CPU.md,
    # "Exit crash"): flush the result, then leave without running the exit handlers.
    queue.close()
    queue.join_thread()
    os._exit(0)


def test_gradient_norm_is_global_across_pipeline_ranks(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_pp_rank, args=(2, str(tmp_path / "init"), queue), nprocs=2, join=True)
    results = sorted(queue.get(timeout=60) for _ in range(2))
    # The whole model's gradient is [1, 2, 2, 4]: norm 5, so each stage's part is scaled by 1/5.
    for rank, norm, grad in results:
        assert norm == pytest.approx(5.0)
        assert grad == pytest.approx([(rank + 1) / 5, 2 * (rank + 1) / 5])

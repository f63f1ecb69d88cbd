"""Train several parallel configs on identical data and weights; save what to compare.

    torchrun --nproc_per_node=N numerics_harness.py [--trainer-data] OUT_DIR CASE [CASE ...]
    python numerics_harness.py OUT_DIR CASE            # the one-process reference

Each CASE is ``name:flag flag ...`` (trainer flags, space separated). Every case starts from
the same weights (one-process init for the seed) and, at every step, consumes the same global
batch: the first windows of the bundled corpus, split by data-parallel rank. With
``--trainer-data`` the trainer keeps its own dataloader instead (and whatever position a
checkpoint gives it). Rank 0 writes ``OUT_DIR/<name>.pt`` with the per-step losses and grad
norms, the full final weights and the bytes its all-gathers sent by dtype.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.dataloader import build_dataloader
from torchtitan.config.manager import parse_args
from torchtitan.distributed.utils import shutdown
from torchtitan.tools.logging import init_logger
from torchtitan.trainer import Trainer


class GlobalBatchSlices:
    """This rank's rows of fixed global batches, so every layout sees the same tokens;
    ``part=(i, n)``: the i-th of n row blocks of batches n times this trainer's (one
    process standing for n data-parallel ranks: ``semi_sync_reference.py``)."""

    def __init__(self, trainer: Trainer, steps: int, *, part: tuple[int, int] | None = None):
        t = trainer.config.training
        dp_rank, dp = part or (trainer.dp_rank, trainer.parallel_dims.dp_degree)
        source = build_dataloader(
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            tokenizer=trainer.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size * dp,
            dp_rank=0,
            dp_world_size=1,
            data_format=t.data_format,
            make_dataset=trainer.data.make_dataset,
            mix=t.mix(),
            shuffle_seed=t.shuffle_seed,
        )
        rows = slice(dp_rank * t.local_batch_size, (dp_rank + 1) * t.local_batch_size)
        it = iter(source)
        self.batches = []
        for _ in range(trainer.batches.batches_through(steps)):
            inputs, labels = next(it)
            self.batches.append(({k: v[rows] for k, v in inputs.items()}, labels[rows]))

    def __iter__(self):
        return iter(self.batches)


def _clean(name: str) -> str:
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


class AllGatherBytes:
    """Bytes each all-gather into one tensor sends from this rank, by dtype (FSDP's weights:
    ``all_gather_single`` in torch 2.13, ``all_gather_into_tensor`` before)."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        self.bytes: dict[str, int] = {}
        self.originals = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(dist, name, self._counting(original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)

    def _counting(self, original):
        def call(output, input, *args, **kwargs):
            key = str(input.dtype)
            self.bytes[key] = self.bytes.get(key, 0) + input.numel() * input.element_size()
            return original(output, input, *args, **kwargs)

        return call


def _replicas_differ(parts: list[torch.nn.Module]) -> tuple[int, list[str]]:
    """How many DTensor parameters are replicated over some mesh dimension, and those whose
    copies differ between that dimension's ranks (every rank calls this alike)."""
    replicated, differ = 0, []
    for part in parts:
        for name, param in part.named_parameters():
            if not isinstance(param, DTensor):
                continue
            for dim, placement in enumerate(param.placements):
                if not placement.is_replicate() or param.device_mesh.size(dim) == 1:
                    continue
                replicated += 1
                group = param.device_mesh.get_group(dim)
                mine = param.to_local().detach().contiguous().flatten().view(torch.uint8)
                copies = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
                dist.all_gather(copies, mine, group=group)
                if any(not torch.equal(copy, mine) for copy in copies):
                    differ.append(_clean(name))
    return replicated, differ


def run_case(out_dir: Path, name: str, flags: list[str], *, trainer_data: bool = False) -> None:
    dump = out_dir / name
    start = time.perf_counter()
    trainer = Trainer(parse_args([*flags, "--job.dump_folder", str(dump)], console_outputs=False))
    if not trainer_data:
        trainer.dataloader = GlobalBatchSlices(trainer, trainer.config.training.steps)
    with AllGatherBytes() as all_gathers:
        trainer.train()
    weights = {}
    for part in trainer.model_parts:
        # Parameters and the buffers a checkpoint saves (MoE expert biases).
        saved = {_clean(k) for k in part.state_dict()}
        buffers = [(n, b) for n, b in part.named_buffers() if _clean(n) in saved]
        for param_name, param in [*part.named_parameters(), *buffers]:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            weights[_clean(param_name)] = full.detach().clone()
    replicas = (0, [])
    if dist.is_initialized():  # every rank's view (pipeline stages hold other parameters)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, _replicas_differ(trainer.model_parts))
        replicas = (sum(n for n, _ in everyone), sorted({d for _, ds in everyone for d in ds}))
    # Pipeline stages hold different parameters, and the replicas of semi-synchronous training
    # their own values: merge them (the last rank's win, as semi_sync_reference.py expects).
    # Other layouts hold every weight whole on every rank already (full_tensor above); the
    # merge cost a 4-rank case 1.5-2 s of its 4-7.
    semi_sync = trainer.config.semi_sync.method != "none"
    if dist.is_initialized() and (trainer.parallel_dims.pp_enabled or semi_sync):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, weights)
        weights = {k: v for rank_weights in gathered for k, v in rank_weights.items()}
    trainer.close()
    # Each case compiles afresh: two compiled TP MoE cases in a row, sharing dynamo's state,
    # failed the second one in tracing (RecursionError); each passes alone.
    torch._dynamo.reset()
    if not dist.is_initialized() or dist.get_rank() == 0:
        lines = (dump / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        saved = {"records": records, "weights": weights, "all_gather_bytes": all_gathers.bytes}
        saved["replicated"], saved["replicas_differ"] = replicas
        saved["seconds"] = time.perf_counter() - start  # what the case cost the launch
        torch.save(saved, out_dir / f"{name}.pt")


def main() -> None:
    init_logger()
    args = sys.argv[1:]
    trainer_data = args[0] == "--trainer-data"
    out_dir = Path(args[trainer_data])
    for case in args[trainer_data + 1 :]:
        name, _, flags = case.partition(":")
        run_case(out_dir, name, flags.split(), trainer_data=trainer_data)
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)

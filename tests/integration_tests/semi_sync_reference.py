"""The one-process reference of semi-synchronous training: each replica a one-process trainer
on its rows of the global batches (as ``numerics_harness.py`` splits them among the
data-parallel ranks), the replicas' meetings written out here with ``torch.optim.SGD``.

    python semi_sync_reference.py OUT_DIR CASES_JSON

CASES_JSON: a list of ``{"name", "flags", "replicas", "rows", "method", "sync_steps",
"num_fragments", "outer_lr", "outer_momentum", "nesterov", "alpha"}`` (``flags``: a replica's trainer
flags; ``rows``: sequences per replica per step). Writes ``OUT_DIR/<name>.pt``: each step's
loss over all replicas' tokens and replica 0's, the replicas' gradient norms' root mean
square, and the last replica's final weights (with the buffers a checkpoint holds).
"""

import json
import os
import re
import sys
from pathlib import Path

import torch
from numerics_harness import GlobalBatchSlices, _clean

from torchtitan.config.manager import parse_args
from torchtitan.distributed.utils import shutdown
from torchtitan.models.common.moe import moe_layers
from torchtitan.tools.logging import init_logger
from torchtitan.trainer import Trainer


class _Continuing:
    """Batches that go on where the last ``train(until=...)`` left them."""

    def __init__(self, batches):
        self.it = iter(batches)

    def __iter__(self):
        return self.it


def _fragment(name: str, fragments: int, n_layers: int) -> int:
    block = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if block:
        return int(block.group(1)) * fragments // n_layers
    return 0 if name.startswith("tok_embeddings") else fragments - 1


def simulate(out_dir: Path, case: dict) -> None:
    name, replicas, steps = case["name"], case["replicas"], None
    trainers, sums = [], []
    for r in range(replicas):
        flags = [*case["flags"].split(), "--training.local_batch_size", str(case["rows"])]
        flags += ["--job.dump_folder", str(out_dir / name / f"replica{r}")]
        trainer = Trainer(parse_args(flags, console_outputs=False))
        steps = trainer.config.training.steps
        trainer.dataloader = _Continuing(GlobalBatchSlices(trainer, steps, part=(r, replicas)))
        losses: dict[int, tuple[float, int, float]] = {}
        step_of = trainer.train_step

        def recorded(batches, trainer=trainer, losses=losses, step_of=step_of):
            result = step_of(batches)
            tokens, norm = int(result.global_tokens), float(result.grad_norm)
            losses[trainer.step] = (float(result.loss_sum.sum()), tokens, norm)
            return result

        trainer.train_step = recorded
        # MoE routing biases move after each step by the counts of every replica (as the
        # real run sums them over all its data-parallel ranks): after all replicas' steps.
        stepped = trainer._after_optimizer_step
        if stepped is not None:
            trainer._after_optimizer_step = lambda *args, **kwargs: {}
        trainers.append(trainer)
        sums.append(losses)
    own = [dict(t.model_parts[0].named_parameters()) for t in trainers]
    n_layers = trainers[0].model_args.n_layers
    synced = {n: p.detach().clone() for n, p in own[0].items() if p.requires_grad}
    outer = torch.optim.SGD(
        list(synced.values()), lr=case["outer_lr"], momentum=case["outer_momentum"],
        nesterov=case["nesterov"] and case["outer_momentum"] > 0,
    )  # fmt: skip
    h, fragments = case["sync_steps"], case["num_fragments"]
    for step in range(1, steps + 1):
        for trainer in trainers:
            trainer.train(until=step)
        if stepped is not None:
            layers = [moe_layers(t.model_parts) for t in trainers]
            alike = zip(*[[m for _, m in ls] for ls in layers], strict=True)  # a layer's replicas
            counts = [sum(m.tokens_per_expert for m in same) for same in alike]
            for trainer, ls in zip(trainers, layers, strict=True):
                for (_, m), total in zip(ls, counts, strict=True):
                    m.tokens_per_expert.copy_(total)
                stepped(trainer.model_parts, None, None, report=False)
        due = {f for f in range(fragments) if step % h == (f + 1) * h // fragments % h}
        names = [n for n in synced if _fragment(n, fragments, n_layers) in due]
        with torch.no_grad():
            for n in names:
                if case["method"] == "diloco":
                    deltas = [(synced[n].float() - o[n].float()) for o in own]
                    synced[n].grad = sum(deltas) / replicas
                else:
                    synced[n].copy_(sum(o[n].float() for o in own) / replicas)
            if case["method"] == "diloco" and names:
                outer.step()
                outer.zero_grad(set_to_none=True)
            for n in names:
                for o in own:
                    o[n].mul_(case["alpha"]).add_(synced[n], alpha=1 - case["alpha"])
    loss = {s: sum(m[s][0] for m in sums) / sum(m[s][1] for m in sums) for s in sums[0]}
    first = {s: v[0] / v[1] for s, v in sums[0].items()}
    # The norm every rank logs: the root mean square of the replicas' own.
    norm = {s: (sum(m[s][2] ** 2 for m in sums) / replicas) ** 0.5 for s in sums[0]}
    # The last replica's (and its routing biases): the harness merges every rank's weights, the
    # last rank's last.
    weights = {
        _clean(n): t.detach().clone() for n, t in trainers[-1].model_parts[0].state_dict().items()
    }
    for trainer in trainers:
        trainer.close()
    record = {"loss": loss, "loss_local": first, "grad_norm": norm, "weights": weights}
    torch.save(record, out_dir / f"{name}.pt")


def main() -> None:
    init_logger()
    out_dir = Path(sys.argv[1])
    for case in json.loads(sys.argv[2]):
        simulate(out_dir, case)
    shutdown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)

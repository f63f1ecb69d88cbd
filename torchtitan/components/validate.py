"""Validation: the loss on a held-out dataset every ``--validation.freq`` steps.

Each validation is one fresh pass over the validation dataset from its start (a new dataloader:
the training data position is untouched), forward only, in the parallel layout training runs
in (the batch runner's :meth:`~torchtitan.batch_runner.BatchRunner.loss`). Nothing it does
reaches training: no gradients, no random numbers, no MoE balancing counts; the training losses
of a run with validation are bitwise those of a run without.

The loss is the mean over every valid token of the batches validated, like the training loss.
Every rank runs the same number of batches: a batch counts only if every data-parallel rank has
a full one (so a dataset's last partial batch is left out), and ``--validation.steps`` bounds
the count (-1: until the data ends).
"""

import math
import time
from collections.abc import Callable, Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.batch_runner import BatchRunner
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config.job_config import Validation as ValidationConfig
from torchtitan.distributed import local_tensor
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger


class Validator:
    """Runs validations for the trainer; ``build_loader()`` opens this data-parallel rank's
    validation dataloader from the start (host batches of ``local_batch_size`` rows)."""

    def __init__(
        self,
        config: ValidationConfig,
        *,
        build_loader: Callable[[], Iterable],
        runner: BatchRunner,
        loss_mesh: DeviceMesh | None,
    ):
        self.config = config
        self.build_loader = build_loader
        self.runner = runner
        self.loss_mesh = loss_mesh

    def should_run(self, step: int, last_step: int) -> bool:
        """Every ``freq`` steps and after the last one."""
        return step % self.config.freq == 0 or step == last_step

    def run(self, step: int) -> dict[str, float]:
        """One validation; returns its metrics (``validation_loss``, ``validation_perplexity``,
        ``validation_tokens``, ``validation_seconds``) and logs them in one line."""
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.runner.device)
        local_tokens = torch.zeros((), dtype=torch.int64)
        batches = 0
        data = iter(self.build_loader())
        while self.config.steps == -1 or batches < self.config.steps:
            batch = next(data, None)
            # Every rank must run the same batches (their collectives pair up).
            full = 0 if batch is None or len(batch[1]) < self.config.local_batch_size else 1
            if not self._everyone(full):
                break
            inputs, labels = self.runner.local_part(batch)
            local_tokens += (labels != IGNORE_INDEX).sum()
            loss_sum += self.runner.loss((inputs, labels))
            batches += 1
        total = dist_utils.dist_reduce(loss_sum, "sum", self.loss_mesh)
        tokens = int(dist_utils.dist_reduce(local_tokens, "sum", self.loss_mesh))
        seconds = time.perf_counter() - start
        if tokens == 0:
            logger.warning(
                f"Validation at step {step}: no full batch of {self.config.local_batch_size} x "
                f"{self.config.seq_len} tokens in dataset {self.config.dataset}; lower "
                "--validation.local_batch_size or --validation.seq_len"
            )
            return {}
        loss = total / tokens
        perplexity = math.exp(min(loss, 700.0))  # exp overflows a float beyond ~709
        logger.info(
            f"validation at step {step}: loss {loss:7.4f}  perplexity {perplexity:,.2f}  "
            f"({batches} batches, {tokens:,} tokens, {seconds:.1f}s)"
        )
        return {
            "validation_loss": loss,
            "validation_perplexity": perplexity,
            "validation_tokens": tokens,
            "validation_seconds": seconds,
        }

    def _everyone(self, flag: int) -> bool:
        """Whether ``flag`` is 1 on every rank of the loss mesh. Simulated ranks read their
        batches together and run out together (``local_tensor.PerRankBatches``)."""
        alone = self.loss_mesh is None or self.loss_mesh.size() == 1
        # (A dry run's collectives move nothing: its sums are not sums.)
        if alone or local_tensor.is_simulating() or not dist_utils.values_are_real():
            return bool(flag)
        # dist_reduce has sum and max: every rank's flag is 1 when the sum is the mesh size.
        count = dist_utils.dist_reduce(torch.tensor(flag), "sum", self.loss_mesh)
        return int(count) == self.loss_mesh.size()

"""Stochastic rounding of bf16 parameters in the optimizer step
(``--optimizer.stochastic_rounding``, with ``--training.dtype bfloat16``).

A bf16 parameter rounded to nearest loses every update smaller than half its spacing (2^-9 to
2^-8 of the weight): weight decay and the late, small steps of a decaying LR mostly vanish.
Here the optimizer computes the new weight in float32 and rounds it up or down at random, up
with the probability of its distance from the lower neighbour, so that each rounding is
unbiased and small updates add up in expectation.

The random bits are a function of (seed, training step, parameter name, the parameter's shard
coordinates) only: replicas of a parameter (data-parallel replicas, TP-replicated norms) round
alike and stay equal, and a resumed run rounds as the uninterrupted one did.
"""

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class Rounding:
    """Where a step's random bits come from: the seed, the step (set by ``Optimizers.step``)
    and each parameter's name."""

    def __init__(self, seed: int, names: dict[int, str]):
        """``names``: each parameter's name by ``id()`` (the optimizers' parameters live as
        long as this object)."""
        self.seed = seed
        self.names = names
        self.step = 0
        self._generators: dict[torch.device, torch.Generator] = {}

    def round_into_(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write float32 ``value`` (this rank's local values of ``param``, contiguous, owned:
        it is overwritten) into ``param``, rounded at random to ``param``'s dtype."""
        write_rounded_(local(param), value, self.seeded(param))

    def seeded(self, param: torch.Tensor) -> torch.Generator:
        """The generator of ``param``'s bits at this step, at their start (draw them in one
        fixed order)."""
        generator = self._generator(local(param).device)
        return generator.manual_seed(self._key(param))

    def _key(self, param: torch.Tensor) -> int:
        coordinates: list[int] = []
        if isinstance(param, DTensor):
            mine = param.device_mesh.get_coordinate() or []
            coordinates = [
                int(c)
                for c, placement in zip(mine, param.placements, strict=True)
                if not placement.is_replicate()
            ]
        text = f"{self.seed}/{self.step}/{self.names.get(id(param), '')}/{coordinates}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


def write_rounded_(out: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    """Write float32 ``value`` (contiguous, owned: overwritten) into ``out`` (bf16: rounded
    at random with ``generator``'s next bits; float32: as it is)."""
    if out.dtype == torch.float32:
        out.copy_(value)
        return
    if out.dtype != torch.bfloat16:
        raise TypeError(f"stochastic rounding writes bf16 or float32, not {out.dtype}")
    round_bits_(value, generator)
    out.copy_(value)  # exact: the low 16 bits are zero


def round_bits_(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round float32 ``value`` in place to a bf16-representable float32, up (away from zero)
    with the probability of its distance from the value below: random low 16 bits are added to
    its bit pattern, then dropped."""
    if value.dtype != torch.float32 or not value.is_contiguous():
        raise ValueError("round_bits_ takes a contiguous float32 tensor")
    nan = value.isnan()  # its bits plus noise could wrap to a zero or an infinity
    bits = value.view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, value.shape, dtype=torch.int32, device=value.device, generator=generator
    )
    bits.add_(noise).bitwise_and_(-65536)  # -65536: 0xFFFF0000, the bf16 bits
    return value.masked_fill_(nan, float("nan"))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def placed_as(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``param``'s placements (it may arrive otherwise, e.g. as partial sums, which
    an optimizer's state must not take as they are)."""
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(placements=param.placements)
    return grad


CHUNK = 1 << 22
"""Elements of a parameter stepped at a time: the step's float32 temporaries (about 24 bytes
an element) stay near 100 MiB however large the local tensor is."""


def adam_step_(optimizer: torch.optim.Optimizer, rounding: Rounding, decoupled: bool) -> None:
    """One step of Adam (AdamW with ``decoupled``), computed in float32 per parameter with the
    moments kept in the parameter's dtype, as torch's fused kernel does, and the new weight
    rounded at random. The state is torch's (``step``, ``exp_avg``, ``exp_avg_sq``), so a
    checkpoint moves between runs with and without rounding. Contiguous parameters step
    ``CHUNK`` elements at a time, their bits drawn in order from one seeded generator."""
    for group in optimizer.param_groups:
        hyper = (*group["betas"], group["lr"], group["eps"], group["weight_decay"], decoupled)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = _adam_state(optimizer.state[p], p, group)
            state["step"] += 1
            # As tensors: no host sync where fused keeps the count on the device, and no
            # value read from the fake tensors of a dry run's probe step.
            step = state["step"].to(torch.float64)
            tensors = [local(placed_as(p.grad, p)), local(p)]
            tensors += [local(state["exp_avg"]), local(state["exp_avg_sq"])]
            generator = rounding.seeded(p)
            if all(t.is_contiguous() for t in tensors):
                flat = [t.view(-1) for t in tensors]
                for start in range(0, flat[0].numel(), CHUNK):
                    chunk = [t[start : start + CHUNK] for t in flat]
                    _adam_update_(*chunk, step, hyper, generator)
            else:
                _adam_update_(*tensors, step, hyper, generator)


def _adam_update_(
    grad: torch.Tensor,
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: tuple,
    generator: torch.Generator,
) -> None:
    """Adam's update of one (piece of a) local tensor, in float32, written back rounded."""
    beta1, beta2, lr, eps, decay, decoupled = hyper
    correction1, correction2 = 1 - beta1**step, (1 - beta2**step).sqrt()
    grad, weight = grad.float(), param.float()
    if not decoupled and decay:
        grad = grad.add(weight, alpha=decay)
    first = exp_avg.float().lerp_(grad, 1 - beta1)
    second = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    exp_avg.copy_(first)
    exp_avg_sq.copy_(second)
    if decoupled:
        weight.mul_(1 - lr * decay)
    # Not in place: for float32 parameters the moments are these very tensors.
    denominator = second.sqrt().div_(correction2).add_(eps)
    weight.sub_(first.div(denominator).mul_(lr / correction1))
    write_rounded_(param, weight.contiguous(), generator)


def _adam_state(state: dict[str, Any], p: torch.Tensor, group: dict[str, Any]) -> dict:
    """``state``, created as torch's Adam creates it at a parameter's first step."""
    if not state:
        on_device = group.get("fused") or group.get("capturable")
        state["step"] = torch.zeros(
            (), dtype=torch.float32, device=p.device if on_device else "cpu"
        )
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """What an optimizer's ``step(closure)`` returns: the closure's loss, computed with
    gradients on (torch's convention), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _RoundedAdam:
    """torch's Adam or AdamW with its step replaced by ``adam_step_``."""

    decoupled: bool

    def __init__(self, params: Iterable[Any], rounding: Rounding, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.rounding = rounding

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = closure_loss(closure)
        adam_step_(self, self.rounding, decoupled=self.decoupled)
        return loss


class RoundedAdamW(_RoundedAdam, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step rounds bf16 weights at random."""

    decoupled = True


class RoundedAdam(_RoundedAdam, torch.optim.Adam):
    """``torch.optim.Adam`` (L2 weight decay) whose step rounds bf16 weights at random."""

    decoupled = False

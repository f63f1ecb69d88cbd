"""Context parallelism (CP): every sequence split over the ``cp`` ranks, attention still exact
over the whole causal sequence (ring attention), or over each token's own document
(block-causal attention: keys and values gathered).

Who does what:

- The batch runner gives each rank its share of every sequence (:func:`shard_batch`): the
  tokens, their labels, and the positions those tokens had, which RoPE follows. With load
  balancing the sequence is cut into ``2 x cp`` chunks and rank i holds chunks i and
  ``2cp-1-i``, so each rank has the same causal attention work (a plain split gives the last
  rank every key to attend to and the first almost none)::

      sequence   | c0 | c1 | c2 | c3 |      cp = 2, load-balanced
      rank 0:    c0 c3                     rank 1:    c1 c2

- A model's plan hooks the modules that take the product over the sequence
  (:func:`apply_cp`): their queries, keys and values become DTensors sharded along the
  sequence on the ``cp`` mesh, so scaled-dot-product attention dispatches to torch's ring
  attention (``torch.distributed.tensor.experimental``). Each rank keeps its queries; the K/V
  shards travel (``allgather``: gathered once; ``alltoall``: passed on shard by shard, less
  memory) and the partial results merge by their log-sum-exp. Gradients of K/V travel back
  the same way. Block-causal attention instead gathers the whole sequence's K/V on every rank
  (:func:`gather_keys_and_values`); the document numbers of the whole sequence stay on every
  rank.
- Everything else is per token (projections, MLPs, norms, the loss): it runs on the local share
  unchanged. FSDP shards the parameters over ``dp_shard x cp`` and gradients are averaged over
  the same ranks; the loss is averaged over ``dp_cp`` (``ParallelDims``).
- On CPU, :mod:`context_parallel_cpu` gives torch's ring attention the CPU kernel it lacks.
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed import local_tensor
from torchtitan.tools.logging import logger

ROTATE_METHODS = ("allgather", "alltoall")


def sequence_order(
    seq_len: int, cp: int, load_balance: bool, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The positions ``0..seq_len-1`` in the order the ``cp`` ranks hold them: rank r holds
    entries ``[r * seq_len / cp, (r + 1) * seq_len / cp)``. Load-balanced: chunks r and
    ``2cp-1-r`` of ``2 x cp`` equal chunks (the layout torch's ring attention expects)."""
    positions = torch.arange(seq_len, device=device)
    if not load_balance:
        return positions
    chunks = positions.view(2 * cp, -1)
    return torch.cat([torch.cat((chunks[r], chunks[2 * cp - 1 - r])) for r in range(cp)])


def rank_positions(seq_len: int, cp_mesh: DeviceMesh, load_balance: bool) -> torch.Tensor:
    """This rank's positions ``[seq_len / cp]`` of a ``seq_len`` sequence (each simulated
    rank's own under ``COMM_MODE=local_tensor``)."""
    cp = cp_mesh.size()
    order = sequence_order(seq_len, cp, load_balance).view(cp, -1)
    return local_tensor.for_each_coordinate(lambda r: order[r], cp_mesh.get_local_rank())


def shard_batch(
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    cp_mesh: DeviceMesh,
    *,
    load_balance: bool,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """This rank's share of a batch (every tensor ``[bs, seq]``): each input and the labels cut
    along the sequence, plus ``positions [bs, seq / cp]`` for the model's RoPE. The
    ``document_ids`` of block-causal attention stay whole: each rank's queries see keys of the
    whole sequence, and their documents."""
    positions = rank_positions(labels.shape[1], cp_mesh, load_balance)
    local = {
        name: t if name == "document_ids" else t.index_select(1, positions)
        for name, t in inputs.items()
    }
    local["positions"] = positions.expand(labels.shape[0], -1)
    return local, labels.index_select(1, positions)


def apply_cp(
    modules: Iterable[nn.Module],
    cp_mesh: DeviceMesh,
    *,
    rotate_method: str,
    load_balance: bool,
    gather: bool = False,
) -> None:
    """Make each module's scaled-dot-product attention exact over the sequence split on
    ``cp_mesh``: ring attention, or with ``gather`` (block-causal attention, attention sinks,
    sliding windows) the gathered K/V.

    Each module takes ``(q, k, v)`` as ``[bs, heads, seq, head_dim]`` local shards (in the
    :func:`sequence_order` layout) and returns its attention output for the local queries; the
    product must be causal SDPA (``models/common/attention.py``). The rotate method and load
    balancing are process-wide settings of torch's ring attention.

    ``gather``: the modules are ``models.common.attention.ScaledDotProductAttention``
    (taking the whole sequence's document numbers where block-causal); their K/V are gathered
    instead (:func:`gather_keys_and_values`).
    """
    if gather:
        if rotate_method != "allgather":
            raise ValueError(f"gathered K/V: rotate_method {rotate_method!r} is not allgather")
        for module in modules:
            module.register_forward_pre_hook(
                gather_keys_and_values(cp_mesh, load_balance=load_balance), with_kwargs=True
            )
        return
    # Private torch API, the same in 2.11 and 2.13: the public context_parallel() context
    # shards buffers in place per call; hooks on the attention modules are its module form.
    from torch.distributed.tensor.experimental import _context_parallel as ring

    from torchtitan.distributed import context_parallel_cpu

    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method {rotate_method!r} is not one of {ROTATE_METHODS}")
    ring._enable_context_parallel_dispatcher()
    context_parallel_cpu.register()
    ring._cp_options.enable_load_balance = load_balance
    ring._cp_options.rotate_method = (
        ring._RotateMethod.ALL_GATHER
        if rotate_method == "allgather"
        else ring._RotateMethod.ALL_TO_ALL
    )
    style = ring._ContextParallel(
        seq_dim=2, attention_type=ring._ContextParallel.AttentionType.SDPA
    )
    for module in modules:
        style._apply(module, cp_mesh)


def gather_keys_and_values(cp_mesh: DeviceMesh, *, load_balance: bool) -> Callable:
    """A forward pre-hook for block-causal attention under CP: the module's keys and values
    ``[bs, kv_heads, seq / cp, head_dim]`` gathered from every rank into the whole sequence's
    order, and the module told where its queries sit (``query_positions``).

    Ring attention merges partial results of whole K/V shards, which a block-causal mask cuts
    at document starts anywhere; gathered, each rank computes its queries' rows of the mask
    exactly (one SDPA call per document run on CPU, FlexAttention on a GPU). The gather's
    backward reduce-scatters the K/V gradients to their owners. Each rank holds the whole
    sequence's K/V of a block until its backward (``2 x kv_heads x head_dim`` values per token
    of the sequence), which activation checkpointing frees with the rest of the block.
    """
    import torch.distributed._functional_collectives as funcol

    # Named *_single_autograd from torch 2.13 on; the *_tensor name is deprecated there.
    all_gather = (
        getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    )
    group = cp_mesh.get_group()
    cp = cp_mesh.size()
    simulating = local_tensor.is_simulating()
    rank = None if simulating else cp_mesh.get_local_rank()

    def hook(module, args, kwargs):
        q, k, v, *rest = args
        # A few integer ops per block, not cached: a compiled block traces them (a cache would
        # be state that activation checkpointing's recomputation may not mutate).
        # Built on the device (a host-to-GPU copy would wait for the GPU every block).
        seq, device = k.shape[2] * cp, k.device
        order = sequence_order(seq, cp, load_balance, device=device)
        to_sequence = torch.argsort(order) if load_balance else None
        whole = []
        for t in (k, v):
            t = funcol.wait_tensor(all_gather(t.contiguous(), 2, group))
            if to_sequence is not None:  # gathered rank after rank: back to the sequence's order
                t = t.index_select(2, to_sequence)
            whole.append(t)
        if simulating:  # each simulated rank's own
            positions = rank_positions(seq, cp_mesh, load_balance).to(device)
        else:  # (rank_positions' per-rank dispatch would break a compiled block's guards)
            positions = order.view(cp, -1)[rank]
        query_positions = positions.expand(q.shape[0], -1)
        return (q, *whole, *rest), kwargs | {"query_positions": query_positions}

    return hook


def log_layout(parallelism, seq_len: int, attn_mask: str = "causal") -> None:
    """One start-up line: tokens per rank, the K/V rotation, each rank's attention work."""
    p, cp = parallelism, parallelism.context_parallel_degree
    work = attention_work(seq_len, cp, p.context_parallel_load_balance)
    how = (
        f"rotated by {p.context_parallel_rotate_method}"
        if attn_mask == "causal"
        else "of the whole sequence gathered on every rank (block-causal)"
    )
    which = "" if attn_mask == "causal" else " where a window holds one document"
    logger.info(
        f"Context parallel: {seq_len // cp} of {seq_len} tokens per rank, K/V {how}, load "
        f"balancing {'on' if p.context_parallel_load_balance else 'off'}: attention work per "
        f"rank{which} " + ", ".join(f"{w:.0%}" for w in work)
    )


def attention_work(seq_len: int, cp: int, load_balance: bool) -> list[float]:
    """Each cp rank's share of the causal attention work (query-key pairs it computes)."""
    order = sequence_order(seq_len, cp, load_balance).view(cp, -1)
    pairs = [int((rows + 1).sum()) for rows in order]
    return [n / sum(pairs) for n in pairs]

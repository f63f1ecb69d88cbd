"""Block-causal attention over packed documents: each document of a window trains as if it
were alone (outputs and gradients), and a window of one document trains as plain causal."""

import contextlib
import unittest.mock

import pytest
import torch

from torchtitan.components.dataloader import document_ids
from torchtitan.components.loss import cross_entropy_sum
from torchtitan.config.job_config import ActivationCheckpoint, Compile
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import sequence_order
from torchtitan.models.common import attention as attention_module
from torchtitan.models.common.attention import (
    BlockMask,
    ScaledDotProductAttention,
    attention_documents,
    block_causal_block_mask,
    block_causal_mask,
)
from torchtitan.models.llama3.args import Llama3Args
from torchtitan.models.llama3.model import Transformer

ARGS = Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
BOS = 1


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    return model


def test_document_ids_count_the_starts_and_the_mask_stays_inside_a_document():
    tokens = torch.tensor([[7, BOS, 5, 6, BOS, 9]])
    documents = document_ids(tokens, BOS)
    assert documents.tolist() == [[0, 1, 1, 1, 2, 2]]
    mask = block_causal_mask(documents)[0, 0]
    assert mask.shape == (6, 6)
    assert mask[3].tolist() == [False, True, True, True, False, False]
    assert mask[5].tolist() == [False, False, False, False, True, True]
    assert not mask.triu(1).any()  # never a later token


def test_packed_documents_train_as_each_document_alone():
    """Three documents packed into one window: the logits of each document's tokens, and the
    parameter gradients of the summed loss, equal those of the documents run one by one."""
    g = torch.Generator().manual_seed(1)
    lengths = (9, 6, 11)
    docs = [
        torch.cat([torch.tensor([BOS]), torch.randint(2, 128, (n - 1,), generator=g)])
        for n in lengths
    ]
    packed = torch.cat(docs).unsqueeze(0)
    labels = torch.randint(2, 128, packed.shape, generator=g)

    model = _model()
    logits = model(packed, document_ids=document_ids(packed, BOS))
    cross_entropy_sum(logits, labels).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    alone = _model()
    start = 0
    for doc, n in zip(docs, lengths, strict=True):
        one = alone(doc.unsqueeze(0))
        torch.testing.assert_close(one, logits[:, start : start + n].detach(), rtol=1e-5, atol=1e-5)
        cross_entropy_sum(one, labels[:, start : start + n]).backward()
        start += n
    for name, p in alone.named_parameters():
        torch.testing.assert_close(p.grad, packed_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_one_document_per_window_is_plain_causal():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(2, 128, (3, 16), generator=g)
    tokens[:, 0] = BOS
    model = _model()
    causal = model(tokens)
    block = model(tokens, document_ids=document_ids(tokens, BOS))
    torch.testing.assert_close(block, causal, rtol=1e-5, atol=1e-5)
    # A second document in the window changes what its tokens see.
    tokens[1, 8] = BOS
    block = model(tokens, document_ids=document_ids(tokens, BOS))
    assert not torch.allclose(block[1, 8:], causal[1, 8:], atol=1e-3)
    torch.testing.assert_close(block[1, :8], causal[1, :8], rtol=1e-5, atol=1e-5)


def test_compiled_attention_takes_the_dense_mask_and_agrees_with_the_per_document_calls():
    """Eager on CPU, block-causal attention is one SDPA call per document; compiled (shapes
    must not depend on the data) it is SDPA with the dense mask: the same values."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 24, 8, generator=g)
    k, v = (torch.randn(2, 2, 24, 8, generator=g) for _ in "kv")
    tokens = torch.randint(2, 128, (2, 24), generator=g)
    tokens[0, [0, 5, 17]] = BOS
    tokens[1, 11] = BOS
    documents = document_ids(tokens, BOS)
    attention = ScaledDotProductAttention()
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("attn_mask") is not None)
        return real_sdpa(*args, **kwargs)

    with unittest.mock.patch("torch.nn.functional.scaled_dot_product_attention", counting):
        eager = attention(q, k, v, documents)
    assert calls == [False] * 5  # 3 documents in row 0, 2 in row 1 (one begun before the window)
    compiled = torch.compile(attention, backend="inductor", fullgraph=True)(q, k, v, documents)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    dense = real_sdpa(q, k, v, attn_mask=block_causal_mask(documents), enable_gqa=True)
    torch.testing.assert_close(dense, eager, rtol=1e-5, atol=1e-5)


def test_narrow_value_heads_are_padded_for_the_fused_kernel_and_stay_exact():
    """Multi-head latent attention's values are narrower than its queries/keys: padded to run
    the fused kernel (the CPU flash kernel refuses unequal widths), the outputs and gradients
    equal the math kernel's on the unpadded tensors, causal and block-causal."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 4, 12, 24, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 12, 16, generator=g, requires_grad=True)
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    sdpa = ScaledDotProductAttention(scale=0.3)
    for docs, mask in ((None, None), (documents, block_causal_mask(documents))):
        fused = sdpa(q, k, v, docs)
        fused_grads = torch.autograd.grad(fused.square().sum(), (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            math = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=0.3
            )
        math_grads = torch.autograd.grad(math.square().sum(), (q, k, v))
        assert fused.shape == (2, 4, 12, 16)
        torch.testing.assert_close(fused, math, rtol=1e-5, atol=1e-5)
        for got, want in zip(fused_grads, math_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with _OpLog() as log:
        sdpa(q, k, v)
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in log.ops


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run inside the context."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's block mask: CUDA only")
def test_cuda_takes_a_flex_block_mask_equal_to_the_dense_mask():
    """On CUDA the model builds a FlexAttention block mask once per forward; its logits and
    gradients equal the dense-mask SDPA path's (fp32, documents crossing the 128-token blocks
    FlexAttention skips by)."""
    args = Llama3Args(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=512)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(2, 128, (2, 512), generator=g)
    tokens[0, [0, 100, 300, 301]] = BOS
    tokens[1, [0, 255, 256]] = BOS
    tokens, labels = tokens.cuda(), torch.randint(2, 128, (2, 512), generator=g).cuda()
    documents = document_ids(tokens, BOS)
    assert isinstance(attention_documents(documents), BlockMask)

    def run(flex: bool):
        torch.manual_seed(0)
        model = Transformer(args).cuda()
        model.init_weights()
        patch = unittest.mock.patch(
            "torchtitan.models.llama3.model.attention_documents", side_effect=lambda d, p: d
        )
        with contextlib.nullcontext() if flex else patch:
            logits = model(tokens, document_ids=documents)
        cross_entropy_sum(logits, labels).backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    flex_logits, flex_grads = run(flex=True)
    dense_logits, dense_grads = run(flex=False)
    torch.testing.assert_close(flex_logits, dense_logits, rtol=1e-4, atol=1e-4)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)


def test_checkpointed_compiled_blocks_take_the_flex_block_mask(monkeypatch):
    """CUDA's training path, run on CPU: blocks wrapped by per-op activation checkpointing,
    then compiled (as the trainer builds them), take FlexAttention with the block mask; their
    logits equal the eager dense mask's (forward only: FlexAttention has no CPU backward;
    ``test_cuda_takes_a_flex_block_mask_equal_to_the_dense_mask`` checks gradients on CUDA).
    The first call of FlexAttention happens inside a compiled, checkpointed block: torch 2.11
    on an H100 refused the run there ("HOP: Unsafe side effect", when the attention cached its
    compiled FlexAttention in module state)."""
    monkeypatch.setattr(attention_module, "_COMPILED", {})  # as in a fresh process
    args = Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=256)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(2, 128, (2, 256), generator=g)
    tokens[0, [0, 70, 130, 131]] = BOS
    tokens[1, [0, 200]] = BOS
    documents = document_ids(tokens, BOS)

    def run(compiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights()
        model.requires_grad_(False)
        if compiled:
            apply_ac(model.layers, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
            apply_compile(model.layers, Compile(enable=True, backend="aot_eager"))
        flex = unittest.mock.patch(
            "torchtitan.models.llama3.model.attention_documents",
            side_effect=lambda d, p: block_causal_block_mask(d),
        )
        with flex if compiled else contextlib.nullcontext():
            return model(tokens, document_ids=documents)

    torch.testing.assert_close(run(compiled=True), run(compiled=False), rtol=1e-4, atol=1e-4)


def test_the_flex_block_mask_holds_the_blocks_and_the_mask_of_block_causal_attention():
    """What CUDA runs take, built here on CPU (compiled, as there): FlexAttention visits the
    128 x 128 tiles where the dense mask has an entry, and its mask function is the mask."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, 128, (2, 512), generator=g)
    tokens[0, [0, 100, 300, 301]] = BOS
    tokens[1, [0, 255, 256]] = BOS
    documents = document_ids(tokens, BOS)
    block_mask = block_causal_block_mask(documents)
    dense = block_causal_mask(documents)
    tiles = dense.view(2, 1, 4, 128, 4, 128).any(dim=(3, 5))
    assert block_mask.to_dense().bool().equal(tiles)
    b, h, q, kv = torch.meshgrid(*(torch.arange(n) for n in dense.shape), indexing="ij")
    assert block_mask.mask_mod(b, h, q, kv).equal(dense)


def test_a_compiler_failure_builds_the_block_mask_eagerly(monkeypatch, caplog):
    from torchtitan.models.common import attention

    def fails(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setitem(attention._COMPILED, "create_block_mask", fails)
    documents = torch.tensor([[0, 0, 1, 1, 1, 2]])
    block_mask = block_causal_block_mask(documents)
    assert isinstance(block_mask, BlockMask)
    assert attention._COMPILED["create_block_mask"] is attention.create_block_mask
    assert "building it eagerly" in caplog.text


def test_off_cuda_the_document_numbers_pass_through():
    documents = torch.tensor([[0, 0, 1, 1]])
    assert attention_documents(documents) is documents
    assert attention_documents(None) is None


def _packed_attention_inputs(seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, seq, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, seq, 8, generator=g, requires_grad=True) for _ in "kv")
    tokens = torch.randint(2, 128, (2, seq), generator=g)
    tokens[0, [0, 5, 9, 10, 17, 30]] = BOS  # starts inside, at and across the chunks below
    tokens[1, 13] = BOS  # row 1 begins inside a document that began before the window
    return q, k, v, document_ids(tokens, BOS)


@pytest.mark.parametrize("cp, load_balance", [(2, True), (4, True), (4, False)])
def test_a_ranks_queries_at_their_positions_see_what_they_see_in_the_whole_sequence(
    cp, load_balance
):
    """Context parallelism with block-causal attention: each rank attends the queries of its
    tokens (the ring's head-tail chunks) to the whole sequence's keys. Their outputs are the
    rows of whole-sequence attention at those positions, and the gradients summed over the
    ranks are the whole-sequence gradients: through the per-document calls (eager CPU) and the
    dense mask (compiled), and the flex block mask holds the same mask."""
    seq = 32
    q, k, v, documents = _packed_attention_inputs(seq, seed=4)
    weights = torch.randn(2, 4, seq, 8, generator=torch.Generator().manual_seed(5))
    attention = ScaledDotProductAttention()
    whole = attention(q, k, v, documents)
    want = torch.autograd.grad((whole * weights).sum(), (q, k, v))
    order = sequence_order(seq, cp, load_balance).view(cp, -1)
    compiled = torch.compile(attention, backend="inductor", fullgraph=True)
    for run in (attention, compiled):
        loss = 0
        for positions in order:
            where = positions.expand(2, -1)
            out = run(q[:, :, positions], k, v, documents, query_positions=where)
            torch.testing.assert_close(out, whole[:, :, positions], rtol=1e-5, atol=1e-5)
            loss = loss + (out * weights[:, :, positions]).sum()
        for got, expected in zip(torch.autograd.grad(loss, (q, k, v)), want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    dense = block_causal_mask(documents)
    for positions in order:
        where = positions.expand(2, -1)
        rows = block_causal_mask(documents, where)
        assert rows.equal(dense[:, :, positions])
        block_mask = block_causal_block_mask(documents, where)
        b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in rows.shape), indexing="ij")
        assert block_mask.mask_mod(b, h, i, j).equal(rows)


def test_flex_attention_of_a_ranks_queries_equals_the_whole_sequences_rows():
    """What CUDA runs under context parallelism, run here on CPU (compiled FlexAttention): the
    block mask built for a rank's queries (128-token tiles of its head and tail chunks against
    the whole sequence) gives the rows of whole-sequence block-causal attention."""
    g = torch.Generator().manual_seed(3)
    seq = 512
    tokens = torch.randint(2, 128, (2, seq), generator=g)
    tokens[0, [0, 100, 300, 301]] = BOS
    tokens[1, [0, 255, 256]] = BOS
    documents = document_ids(tokens, BOS)
    q = torch.randn(2, 4, seq, 16, generator=g)
    k, v = (torch.randn(2, 2, seq, 16, generator=g) for _ in "kv")
    whole = ScaledDotProductAttention()(q, k, v, documents)
    for positions in sequence_order(seq, 2, True).view(2, -1):
        where = positions.expand(2, -1)
        block_mask = block_causal_block_mask(documents, where)
        tiles = block_causal_mask(documents, where).view(2, 1, 2, 128, 4, 128).any(dim=(3, 5))
        assert block_mask.to_dense().bool().equal(tiles)
        attention = ScaledDotProductAttention()
        out = attention(q[:, :, positions], k, v, block_mask)
        torch.testing.assert_close(out, whole[:, :, positions], rtol=1e-5, atol=1e-5)


def test_causal_attention_with_repeated_kv_heads_equals_grouped_query_attention():
    """Where no fused kernel takes grouped queries (CUDA in float32), K/V heads are repeated:
    the same attention, outputs and gradients."""
    from torchtitan.models.common import attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    sdpa = ScaledDotProductAttention()
    grouped = sdpa(q, k, v)
    grads = torch.autograd.grad(grouped.sum(), (q, k, v))
    with unittest.mock.patch.object(attention, "_no_fused_gqa", return_value=True) as check:
        repeated = sdpa(q, k, v)
        assert check.called
    torch.testing.assert_close(repeated, grouped)
    for got, want in zip(torch.autograd.grad(repeated.sum(), (q, k, v)), grads, strict=True):
        torch.testing.assert_close(got, want)

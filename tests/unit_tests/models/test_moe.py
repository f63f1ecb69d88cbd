"""Mixture of experts (models/common/moe.py) and the DeepSeek-V3 family: routing, the two
expert paths, capacity, the balance loss and bias, published sizes, config refusals."""

import os
import subprocess
import sys

import pytest
import torch

from torchtitan.models.common import experts as routed_experts
from torchtitan.models.common import moe
from torchtitan.models.common.moe_args import MoEArgs
from torchtitan.models.deepseek_v3 import flavors, model_spec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _experts(
    impl: str, dtype: torch.dtype, num=4, dim=64, hidden=32
) -> routed_experts.GroupedExperts:
    torch.manual_seed(0)
    experts = routed_experts.GroupedExperts(dim, hidden, num, impl).to(dtype)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.1)
    return experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[10, 0, 20, 7], [16, 16, 0, 0], [0, 0, 0, 3], [0, 0, 0, 0]])
def test_grouped_mm_equals_the_loop_forward_and_backward(dtype, counts):
    loop, grouped = _experts("loop", dtype), _experts("grouped_mm", dtype)
    assert grouped.uses_grouped_mm(dtype) and not loop.uses_grouped_mm(dtype)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 64, dtype=dtype)
    outs, grads = [], []
    for experts in (loop, grouped):
        xi = x.clone().requires_grad_()
        out = experts(xi, counts)
        out.float().pow(2).sum().backward()
        outs.append(out)
        grads.append([xi.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad])
    # Each row's products are the same sums, but padding an expert's rows to 16 can pick another
    # BLAS kernel: equal to the last bit on Intel CPUs; on AMD EPYC outputs 2.4e-7 and weight
    # gradients (sums over rows) 1.7e-6 apart.
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_biased_clamped_experts_agree_on_every_path_and_with_their_formula():
    """gpt-oss's experts (biases on the three projections, the clamped SwiGLU): the loop, the
    grouped GEMM and the grouped GEMM without a host sync (a padded buffer longer than the
    groups, whose extra rows hold garbage) give the same outputs and gradients, and an
    expert's rows compute ``(clamp(up) + 1) * gate * sigmoid(1.702 * gate)`` written out."""
    gating = routed_experts.clamped_swiglu(limit=7.0, alpha=1.702)
    torch.manual_seed(0)
    experts = routed_experts.GroupedExperts(64, 32, 4, "loop", bias=True, activation=gating)
    for name, p in experts.named_parameters():  # biases large enough to reach the clamps
        torch.nn.init.normal_(p, std=3.0 if name.endswith("bias") else 0.3)
    counts = torch.tensor([10, 0, 20, 7])
    x = torch.randn(37, 64)
    params = list(experts.parameters())
    results = []
    for path in ("loop", "grouped", "grouped_nosync"):
        xi = x.clone().requires_grad_()
        weights = [experts.w1, experts.w2, experts.w3]
        biases = [experts.w1_bias, experts.w2_bias, experts.w3_bias]
        if path == "loop":
            out = routed_experts._loop_experts(
                xi, counts, *weights, biases=biases, activation=gating
            )
        else:
            out = routed_experts._grouped_mm_experts(
                xi, counts, *weights, biases=biases, activation=gating,
                max_padding=path == "grouped_nosync",
            )  # fmt: skip
        grads = torch.autograd.grad(out.pow(2).sum(), [xi, *params])
        results.append((out, grads))
    # Summation order differs (padded groups can take other BLAS kernels): to 1e-5 of scale.
    for out, grads in results[1:]:
        for got, want in zip((out, *grads), (results[0][0], *results[0][1]), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    rows = x[10:30]  # expert 2's
    gate = rows @ experts.w1[2].T + experts.w1_bias[2]
    up = rows @ experts.w3[2].T + experts.w3_bias[2]
    assert (gate > 7).any() and (up.abs() > 7).any()  # the clamps act
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    want = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ experts.w2[2].T + experts.w2_bias[2]
    torch.testing.assert_close(results[0][0][10:30], want, rtol=1e-5, atol=1e-4)


def test_auto_takes_the_loop_where_the_grouped_gemm_cannot_run():
    assert routed_experts.GroupedExperts(64, 32, 4, "auto").uses_grouped_mm(torch.float32)
    # fp32 rows of 10 values are 40 bytes: not 16-byte aligned.
    assert not routed_experts.GroupedExperts(10, 32, 4, "auto").uses_grouped_mm(torch.float32)
    assert not routed_experts.GroupedExperts(64, 32, 4, "auto").uses_grouped_mm(torch.float64)


def test_group_limited_routing_picks_experts_only_in_the_best_groups():
    # 4 groups of 2: expert 0 is the best single one, but group 3 (experts 6, 7) is best.
    logits = torch.tensor([[2.0, -5, -5, -5, -5, -5, 1.5, 1.5]])
    choice = moe._limit_to_top_groups(logits.sigmoid(), 4, 1)
    assert torch.isinf(choice[0, :6]).all() and torch.isfinite(choice[0, 6:]).all()
    # Without the limit the best single expert (0) would be picked.
    assert 0 in logits.sigmoid().topk(2).indices[0].tolist()


def test_router_bias_steers_the_choice_but_not_the_weights():
    args = MoEArgs(num_experts=4, top_k=1, route_norm=False, score_func="sigmoid")
    router = moe.Router(4, args)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(4))
    x = torch.tensor([[1.0, 0.5, 0.0, 0.0]])
    weights, indices, _ = router(x, None)
    assert indices.item() == 0
    weights, indices, _ = router(x, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert indices.item() == 1
    assert weights.item() == pytest.approx(torch.sigmoid(torch.tensor(0.5)).item())


def _layer(**kwargs) -> moe.MoE:
    torch.manual_seed(0)
    layer = moe.MoE(32, 32, MoEArgs(num_experts=4, top_k=2, **kwargs))
    with torch.no_grad():
        layer.init_weights(0.02)
        torch.nn.init.normal_(layer.router.gate.weight)
    return layer


def test_forced_balance_routes_round_robin_weighted_by_the_routers_scores():
    """--moe.force_load_balance: every expert gets the same routings whatever steers the
    choice; the weights are the router's normalised scores for them, so the router learns."""
    layer = _layer(force_load_balance=True)
    layer.expert_bias.copy_(torch.tensor([10.0, 0, 0, 0]))  # would send every token to 0
    x = torch.randn(1, 6, 32)  # 6 tokens x top 2 = 12 routings: 3 per expert
    weights, indices, scores = layer.router(x.view(6, 32), layer.expert_bias)
    assert indices.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]]
    picked = scores.gather(1, indices)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))
    layer(x).sum().backward()
    assert layer.tokens_per_expert.tolist() == [3.0] * 4
    assert layer.router.gate.weight.grad.abs().sum() > 0
    unforced = _layer()
    assert unforced.router(x.view(6, 32), layer.expert_bias)[1].eq(0).any(-1).all()


@pytest.mark.parametrize("impl", ["loop", "grouped_mm", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shapes_only_forward_runs_on_every_path(impl, dtype):
    """Pipeline stages and dry runs run the experts on meta tensors (no counts to read): bf16
    parameters (--training.dtype) on the loop path took the loop, which reads the counts."""
    with torch.device("meta"):
        experts = routed_experts.GroupedExperts(64, 32, 4, impl).to(dtype)
        x = torch.empty(10, 64, dtype=dtype)
        counts = torch.empty(4, dtype=torch.int64)
    assert experts(x, counts).shape == (10, 64)


def test_capacity_drops_the_lowest_weighted_routings_beyond_it():
    layer = _layer(capacity_factor=0.5, load_balance_coeff=0)
    x = torch.randn(1, 32, 32)
    flat = x.reshape(-1, 32)
    weights, indices, _ = layer.router(flat, None)
    routed = indices.flatten()
    counts = torch.bincount(routed, minlength=4)
    order = routed.argsort(stable=True)
    kept, kept_counts, kept_weights = moe._drop_over_capacity(
        order, counts, weights.flatten(), routed, 0.5
    )
    capacity = 8  # 0.5 x 32 tokens x 2 / 4 experts
    assert kept_counts.tolist() == counts.clamp(max=capacity).tolist()
    assert (routed[kept].diff() >= 0).all()  # grouped by expert
    for e in range(4):
        mine = (routed == e).nonzero().flatten()
        dropped = mine[kept_weights[mine] == 0]
        survivors = mine[kept_weights[mine] != 0]
        if len(dropped):
            assert weights.flatten()[dropped].max() <= weights.flatten()[survivors].min()
    assert layer(x).shape == x.shape


def test_balance_loss_gradient_is_added_with_the_token_weight():
    """The layer adds coeff x loss_scale x tokens x d(aux) to its router's gradient."""
    x = torch.randn(2, 8, 32)
    plain, with_aux = _layer(load_balance_coeff=0), _layer(load_balance_coeff=0, aux_loss_coeff=0.1)
    with_aux.loss_scale = 0.25
    plain(x).sum().backward()
    with_aux(x).sum().backward()
    # The same term computed by hand on the plain layer's router.
    reference = _layer(load_balance_coeff=0)
    _, indices, scores = reference.router(x.reshape(-1, 32), None)
    aux = 0.1 * moe.sequence_balance_loss(scores.view(2, 8, -1), indices.view(2, 8, -1))
    (aux * 0.25 * 16).backward()
    expected = plain.router.gate.weight.grad + reference.router.gate.weight.grad
    torch.testing.assert_close(with_aux.router.gate.weight.grad, expected)
    assert with_aux.aux_loss is not None and float(with_aux.aux_loss) > 0


def test_balanced_routing_has_a_balance_loss_of_one_per_coefficient():
    scores = torch.full((1, 4, 4), 0.5)
    indices = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    assert moe.sequence_balance_loss(scores, indices).item() == pytest.approx(1.0)


def test_bias_update_moves_towards_balance_and_reports_the_load():
    layer = _layer(load_balance_coeff=0.01)
    layer.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 3.0, 5.0]))  # mean 5
    metrics = moe.update_expert_biases([torch.nn.ModuleDict({"m": layer})], None)
    assert layer.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.0])
    assert metrics["moe_load_max_over_mean"] == pytest.approx(2.0)
    assert metrics["moe_load_max_over_mean/m"] == pytest.approx(2.0)
    assert metrics["moe_bias_update"] == pytest.approx(0.0075)
    assert layer.tokens_per_expert.sum() == 0


@pytest.mark.parametrize(
    ("flavor", "total", "activated"),
    # Published: DeepSeek-V2-Lite 15.7B total / 2.4B activated; DeepSeek-V3 671B / 37B.
    [("16B", 15.7e9, 2.4e9), ("671B", 671e9, 37e9)],
)
def test_published_sizes(flavor, total, activated):
    args = flavors[flavor]
    assert args.num_params() == pytest.approx(total, rel=0.005)
    assert args.num_params(activated=True) == pytest.approx(activated, rel=0.025)


def test_parameter_count_matches_the_built_debug_model():
    args = model_spec.args_for("debugmodel", seq_len=64)
    with torch.device("meta"):
        model = model_spec.build_model(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    assert "layers.1.moe.expert_bias" in model.state_dict()


@pytest.mark.parametrize(
    ("module", "world", "flags", "expected"),
    [
        (
            "deepseek_v3",
            3,
            ["--parallelism.expert_parallel_degree", "3"],
            "--parallelism.expert_parallel_degree=3 does not divide num_experts=8",
        ),
        (
            "deepseek_v3",
            4,
            ["--parallelism.expert_parallel_degree", "3", "--parallelism.tensor_parallel_degree", "2"],
            "expert_parallel_degree=3 must divide dp_shard x cp x tp = 2 x 1 x 2 = 4",
        ),
        (
            "deepseek_v3",
            8,
            ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4"],
            "expert parallelism spans the TP ranks, so it must be a multiple of 4",
        ),
        (
            "deepseek_v3",
            4,
            [
                "--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                "2", "--parallelism.data_parallel_replicate_degree", "2",
                "--parallelism.tensor_parallel_degree", "1", "--parallelism.context_parallel_degree", "1",
            ],
            None,
        ),
        (
            "deepseek_v3",
            4,
            [
                "--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree",
                "2", "--parallelism.no_enable_sequence_parallel",
            ],
            "--parallelism.no_enable_sequence_parallel with expert and tensor parallelism",
        ),
        ("llama3", 2, ["--parallelism.expert_parallel_degree", "2"], "model llama3 has no experts"),
        # Qwen3: a family with dense and MoE flavors.
        ("qwen3", 2, ["--parallelism.expert_parallel_degree", "2"], "flavor debugmodel has no experts"),
        ("qwen3", 2, ["--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "2"], None),
        (
            "qwen3",
            4,
            [
                "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "2",
                "--parallelism.tensor_parallel_degree", "2", "--parallelism.no_enable_sequence_parallel",
            ],
            "--parallelism.no_enable_sequence_parallel with expert and tensor parallelism",
        ),
        (
            "qwen3",
            2,
            ["--model.flavor", "debugmodel_moe", "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--moe.load_balance_coeff", "1e-3"],
            "--checkpoint.last_save_in_hf with --moe.load_balance_coeff > 0",
        ),
        (
            "qwen3",
            2,
            ["--model.flavor", "debugmodel_moe", "--comm.mode", "local_tensor", "--moe.experts_impl", "loop"],
            "--moe.experts_impl loop under COMM_MODE=local_tensor is not implemented for qwen3",
        ),
        (
            "gpt_oss",
            2,
            ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_rotate_method", "alltoall"],
            "of gpt_oss: attention with sinks and sliding windows gathers the whole sequence's keys",
        ),
        (
            "gpt_oss",
            2,
            ["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--moe.load_balance_coeff", "1e-3"],
            "no place in GptOssForCausalLM",
        ),
        ("gpt_oss", 4, ["--parallelism.tensor_parallel_degree", "4"], "does not divide n_kv_heads=2"),
        (
            "llama4",
            2,
            ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_rotate_method", "alltoall"],
            "of llama4: attention with chunks gathers the whole sequence's keys",
        ),
        (
            "llama4",
            2,
            ["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--moe.load_balance_coeff", "1e-3"],
            "no place in Llama4ForCausalLM",
        ),
        ("llama4", 8, ["--parallelism.tensor_parallel_degree", "8"], "does not divide n_kv_heads=4"),
        ("gpt_oss", 4, ["--parallelism.expert_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"], None),
        (
            "deepseek_v3",
            2,
            ["--comm.mode", "local_tensor", "--moe.capacity_factor", "1.5"],
            "--moe.capacity_factor > 0 under COMM_MODE=local_tensor",
        ),
        ("deepseek_v3", 4, ["--comm.mode", "local_tensor", "--parallelism.tensor_parallel_degree", "2"], None),
        (
            "deepseek_v3",
            4,
            [
                "--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                "4", "--training.seq_len", "64",
            ],
            None,
        ),
        (
            "deepseek_v3",
            8,
            [
                "--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                "16",
            ],
            "expert_parallel_degree=16 must divide dp_shard x cp x tp = 4 x 2 x 1",
        ),
    ],
)  # fmt: skip
def test_bad_expert_layouts_are_refused_before_any_rank_starts(module, world, flags, expected):
    """One line, exit 2, before any rank starts (``expected`` None: a valid layout, exit 0)."""
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan.config.manager", "--check", "--module", module,
         "--config", f"{module}_debugmodel", *flags],
        cwd=REPO, env=os.environ | {"WORLD_SIZE": str(world)}, capture_output=True, text=True,
    )  # fmt: skip
    if expected is None:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_layer_names_in_metrics_ignore_checkpoint_and_compile_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = torch.nn.ModuleDict({"1": torch.nn.ModuleDict({"moe": _layer()})})
    blocks["1"] = checkpoint_wrapper(blocks["1"])
    assert [name for name, _ in moe.moe_layers([blocks])] == ["1.moe"]


def test_evaluation_forwards_do_not_count_tokens():
    layer = _layer().eval()
    layer(torch.randn(1, 8, 32))
    assert layer.tokens_per_expert.sum() == 0
    layer.train()(torch.randn(1, 8, 32))
    assert layer.tokens_per_expert.sum() == 16  # 8 tokens x top 2


def test_tensor_parallelism_must_divide_the_routed_experts_hidden_size_without_ep():
    import dataclasses

    from torchtitan.config.errors import ConfigError
    from torchtitan.models.deepseek_v3.args import check_parallel_degrees

    # Two shared experts: their joint width (2 x 100) splits over 8 ranks, one expert's not.
    base = flavors["debugmodel"]
    args = dataclasses.replace(
        base, moe_inter_dim=100, moe=dataclasses.replace(base.moe, num_shared_experts=2)
    )
    kwargs = dict(flavor="custom", sequence_parallel=False, seq_len=64)
    with pytest.raises(ConfigError, match="does not divide the routed experts' hidden size=100"):
        check_parallel_degrees(args, tp=8, ep=1, **kwargs)
    check_parallel_degrees(args, tp=8, ep=8, **kwargs)  # EP splits the routed experts instead

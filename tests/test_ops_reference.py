"""The torch reference ops (what CPU tensors run) against naive loops, the runtime's route orders
as the permutation's inputs, the autograd wiring of the ops, and the device choice.

Tolerances: fp32 results against float64 loops from the same inputs, max error <= 2e-5 of the
largest magnitude (summation order only); bf16 at 3e-2 of it (its rounding noise, ~8e-3 per
rounded value, plus rounded intermediates).
"""
import logging

import pytest
import torch
import torch.nn.functional as F

from ds_fssdp import ops
from ds_fssdp.moe.routing import route
from ds_fssdp.ops import dispatch, permute_torch
from test_ops_triton_interpret import ALPHA, GEMM_CASES, LIMIT, MLP_CASES, PERMUTE_CASES, check_gemm, check_mlp, check_permute


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """These tests run the torch reference whatever the environment says."""
    monkeypatch.setenv(dispatch.ENV, "torch")
    dispatch._chosen.clear()
    yield
    dispatch._chosen.clear()


# ---------------------------------------------------------------- grouped GEMM and expert MLP

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("trans_w", [False, True], ids=["w", "w_T"])
@pytest.mark.parametrize("edge", list(GEMM_CASES))
def test_grouped_gemm_edge_cases(edge, trans_w, bias, dtype):
    check_gemm(GEMM_CASES[edge], "cpu", dtype, trans_w=trans_w, bias=bias)


@pytest.mark.parametrize("sizes", [[4, 0, 19], [0, 0, 0]], ids=["some-rows", "no-rows"])
def test_grouped_gemm_tensor_sizes(sizes):
    check_gemm(sizes, "cpu", torch.float32, trans_w=False, sizes_as_tensor=True)


@pytest.mark.parametrize("name", list(MLP_CASES))
def test_expert_mlp(name):
    case = MLP_CASES[name]
    check_mlp(case["sizes"], "cpu", torch.float32, activation=case["activation"], bias=case.get("bias", False),
              act_params=case.get("act_params"), lora_rank=case.get("lora_rank", 0))


@pytest.mark.parametrize("activation", ["swiglu", "geglu_tanh", "gptoss"])
@pytest.mark.parametrize("edge", ["leading-empty", "middle-empty", "trailing-empty", "one-row", "all-in-one",
                                  "balanced"])
def test_expert_mlp_with_biases_edge_cases(edge, activation):
    """The bias paths over the grouped GEMM's edge-case table (the balanced case runs baddbmm)."""
    act_params = {"alpha": ALPHA, "limit": LIMIT} if activation == "gptoss" else None
    check_mlp(GEMM_CASES[edge], "cpu", torch.float32, activation=activation, bias=True, act_params=act_params)


@pytest.mark.parametrize("sizes", [[2, 7, 0], [3, 3, 3]], ids=["uneven", "balanced"])
def test_expert_mlp_on_views_of_flat_rows(sizes):
    """The runtime slices expert weights out of one flat row per expert (non-contiguous views)."""
    torch.manual_seed(4)
    G, H, Fh = 3, 5, 7
    rows = torch.randn(G, 2 * H * Fh, requires_grad=True)
    w_a = rows[:, :H * Fh].reshape(G, H, Fh)
    w_b = rows[:, H * Fh:].reshape(G, Fh, H)
    assert not w_a.is_contiguous()
    x = torch.randn(9, H)
    y = ops.expert_mlp(x, {"w_a": w_a, "w_b": w_b}, sizes, activation="gelu")
    want = torch.cat([F.gelu(x[s - n:s] @ w_a[g]) @ w_b[g]
                      for g, (n, s) in enumerate(zip(sizes, torch.tensor(sizes).cumsum(0).tolist()))])
    torch.testing.assert_close(y, want)
    (g,) = torch.autograd.grad(y.square().sum(), [rows])
    (wg,) = torch.autograd.grad(want.square().sum(), [rows])
    torch.testing.assert_close(g, wg)


class Probe(torch.autograd.Function):
    """Identity that counts its backward calls (stands in for a distributed exchange)."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Probe.calls += 1
        return g


@pytest.mark.parametrize("groups", [3, 0], ids=["empty-groups", "no-groups"])
def test_no_rows_still_reach_the_producer_in_backward(groups):
    leaf = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(groups, 4, 6, requires_grad=True)
    Probe.calls = 0
    y = ops.grouped_gemm(Probe.apply(leaf), w, [0] * groups)
    assert y.shape == (0, 6) and y.requires_grad
    (y.sum() + w.sum()).backward()
    assert Probe.calls == 1
    torch.testing.assert_close(w.grad, torch.ones_like(w))
    Probe.calls = 0
    weights = {"w_gate": torch.randn(groups, 4, 6), "w_up": torch.randn(groups, 4, 6),
               "w_down": torch.randn(groups, 6, 4)}
    ops.expert_mlp(Probe.apply(leaf), weights, [0] * groups, activation="swiglu").sum().backward()
    assert Probe.calls == 1


@pytest.mark.parametrize("sizes,message", [
    ([1, 1], "group sizes sum to 2, but x has 3 rows"),
    ([1, 1, 1], "3 group sizes for 2 weights"),
    ([4, -1], "must be >= 0"),
    (torch.tensor([[1, 2]]), "1-D int32/int64 tensor"),
    (torch.tensor([1.0, 2.0]), "1-D int32/int64 tensor"),
], ids=["sum", "count", "negative", "2-D", "float"])
def test_grouped_gemm_rejects_bad_sizes(sizes, message):
    with pytest.raises(ValueError, match=message):
        ops.grouped_gemm(torch.zeros(3, 2), torch.zeros(2, 2, 2), sizes)


def test_grouped_gemm_rejects_mismatched_operands():
    with pytest.raises(ValueError, match="x has 3 features"):
        ops.grouped_gemm(torch.zeros(2, 3), torch.zeros(1, 2, 2), [2])
    with pytest.raises(ValueError, match="differ"):
        ops.grouped_gemm(torch.zeros(2, 2), torch.zeros(1, 2, 2, dtype=torch.float64), [2])
    with pytest.raises(ValueError, match="activation"):
        ops.expert_mlp(torch.zeros(2, 2), {}, [2], activation="relu")
    with pytest.raises(ValueError, match=r"bias has shape \(2, 2\), expected \[G, F\] = \[1, 3\]"):
        ops.grouped_gemm(torch.zeros(2, 2), torch.zeros(1, 2, 3), [2], bias=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="bias .*differ"):
        ops.grouped_gemm(torch.zeros(2, 2), torch.zeros(1, 2, 3), [2], bias=torch.zeros(1, 3, dtype=torch.float64))


def _swiglu_weights(G=2, H=3, Fh=4):
    return {"w_gate": torch.randn(G, H, Fh), "w_up": torch.randn(G, H, Fh), "w_down": torch.randn(G, Fh, H)}


@pytest.mark.parametrize("activation,act_params,message", [
    ("swiglu_limit", None, r"'swiglu_limit' needs act_params \['limit'\]; missing \['limit'\]"),
    ("gptoss", {"limit": 7.0}, r"'gptoss' needs act_params \['alpha', 'limit'\]; missing \['alpha'\]"),
    ("swiglu", {"limit": 7.0}, r"act_params \['limit'\] are not used by activation 'swiglu'"),
    ("swiglu_limit", {"limit": float("nan")}, r"act_params\['limit'\] \(nan\) must be a finite number"),
    ("swiglu_limit", {"limit": "7"}, r"act_params\['limit'\] \('7'\) must be a finite number"),
    ("geglu_gelu", None, r"activation \('geglu_gelu'\) must be one of"),
], ids=["missing", "one-missing", "unused", "nan", "string", "unknown"])
def test_expert_mlp_rejects_bad_activation_params(activation, act_params, message):
    with pytest.raises(ValueError, match=message):
        ops.expert_mlp(torch.zeros(2, 3), _swiglu_weights(), [1, 1], activation=activation, act_params=act_params)


def test_expert_mlp_rejects_missing_and_unknown_weights():
    weights = _swiglu_weights()
    del weights["w_up"]
    weights["b_a"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"missing \['w_up'\], unknown \['b_a'\]"):
        ops.expert_mlp(torch.zeros(2, 3), weights, [1, 1], activation="swiglu")


# ---------------------------------------------------------------- permutation

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("edge", list(PERMUTE_CASES))
def test_permute_and_combine(edge, dtype):
    check_permute(PERMUTE_CASES[edge], "cpu", dtype)


def test_permute_ops_pass_gradcheck():
    torch.manual_seed(6)
    token_S = torch.tensor([1, 0, 2, 1, 0])
    rows_TK = torch.tensor([[1, 4], [3, 0], [2, -1]])  # token 2 sent once, its second assignment dropped
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: ops.permute_tokens(x, token_S, rows_TK), (x,))
    assert torch.autograd.gradcheck(lambda x: ops.permute_tokens(x, token_S, lambda: rows_TK), (x,))
    y = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, 2, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([[5, 0], [-1, 3], [1, 2]])
    assert torch.autograd.gradcheck(lambda y, w: ops.unpermute_combine(y, rows, w), (y, w))


def test_unpermute_combine_equals_unpermute_then_combine():
    """One row per assignment in a send order: the fused op == index_select back to assignment
    order, then the weighted sum over k, bit for bit (the same products, added in k order)."""
    torch.manual_seed(7)
    T, K = 6, 3
    y = torch.randn(T * K, 5)
    w = torch.rand(T, K)
    unsend_A = torch.randperm(T * K)
    y_TKH = y.index_select(0, unsend_A).reshape(T, K, 5) * w.unsqueeze(2)
    want = y_TKH[:, 0] + y_TKH[:, 1] + y_TKH[:, 2]
    assert torch.equal(ops.unpermute_combine(y, unsend_A.reshape(T, K), w), want)


def test_primitives_worked_examples():
    src = torch.tensor([[1.0, 2], [3, 4], [5, 6]])
    torch.testing.assert_close(permute_torch.gather(src, torch.tensor([2, 0, -1, 2])),
                               torch.tensor([[5.0, 6], [1, 2], [0, 0], [5, 6]]))
    src = torch.tensor([[1.0, 1], [2, 2], [4, 4]])
    out = permute_torch.combine(src, torch.tensor([[2, 0], [1, -1]]), torch.tensor([[0.5, 1], [3, 9]]))
    torch.testing.assert_close(out, torch.tensor([[3.0, 3], [6, 6]]))
    gy, gw = permute_torch.combine_backward(torch.tensor([[1.0, 2]]), torch.tensor([[1.0, 1], [3, 0]]),
                                            torch.tensor([1, 0]), weights_A=torch.tensor([0.5, 2]), K=2)
    torch.testing.assert_close(gy, torch.tensor([[2.0, 4], [0.5, 1]]))
    torch.testing.assert_close(gw, torch.tensor([3.0, 3]))
    assert permute_torch.invert_rows(torch.tensor([[2, -1], [0, 3]]), 5).tolist() == [2, -1, 0, 3, -1]


def random_routing(seed, *, T, K, E, D):
    gen = torch.Generator().manual_seed(seed)
    idx_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    counts_E = torch.bincount(idx_TK.reshape(-1), minlength=E)
    plan_ED = torch.zeros(E, D, dtype=torch.long)
    for e in range(E):  # a random split of each expert's count over the ranks
        cuts = torch.sort(torch.randint(0, int(counts_E[e]) + 1, (D - 1,), generator=gen)).values
        plan_ED[e] = torch.diff(torch.cat([torch.tensor([0]), cuts, counts_E[e:e + 1]]))
    return idx_TK, plan_ED


@pytest.mark.parametrize("seed", range(4))
def test_route_orders_meet_the_permutation_contract(seed):
    """What compute.py hands the ops: the route's send_token and unsend (as [T, K]) are the
    (token_S, rows_TK) of ops.permute_tokens: every sent row once, in its token's line."""
    T, K, E, D = 13, 3, 6, 4
    idx_TK, plan_ED = random_routing(seed, T=T, K=K, E=E, D=D)
    plan_EDD = torch.zeros(E, D, D, dtype=torch.long)
    plan_EDD[:, 1] = plan_ED
    r = route(idx_TK, plan_EDD, rank=1, local_E=torch.arange(E))
    rows_TK = r.unsend.reshape(T, K)
    assert sorted(rows_TK.reshape(-1).tolist()) == list(range(T * K))
    assert torch.equal(r.send_token[rows_TK], torch.arange(T).unsqueeze(1).expand(T, K))
    x = torch.randn(T, 4, dtype=torch.float64, requires_grad=True)
    sent = ops.permute_tokens(x, r.send_token, rows_TK)
    assert torch.equal(sent, x.detach()[r.send_token])
    assert torch.equal(ops.unpermute_combine(sent, rows_TK), K * x.detach())


# ---------------------------------------------------------------- device choice

def test_choice_is_made_once_and_logged(monkeypatch, caplog):
    monkeypatch.setenv(dispatch.ENV, "auto")
    dispatch._chosen.clear()
    with caplog.at_level(logging.INFO, logger="ds_fssdp.ops.dispatch"):
        ops.grouped_gemm(torch.randn(2, 3), torch.randn(1, 3, 2), [2])
        ops.grouped_gemm(torch.randn(2, 3), torch.randn(1, 3, 2), [2])
    lines = [r.getMessage() for r in caplog.records if r.name == "ds_fssdp.ops.dispatch"]
    assert lines == ["ds_fssdp.ops: cpu tensors use the torch implementation "
                     "(the Triton kernels run on CUDA tensors only)"]


def test_choice_errors(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "fast")
    dispatch._chosen.clear()
    with pytest.raises(ValueError, match="DS_FSSDP_OPS_BACKEND \\('fast'\\) must be one of"):
        dispatch.backend_for(torch.device("cpu"))
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dispatch._chosen.clear()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1|triton is not installed"):
        dispatch.backend_for(torch.device("cpu"))


def test_auto_on_cuda_without_triton_picks_torch_and_says_why(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "auto")
    monkeypatch.setattr(dispatch, "_triton_problem", lambda: "triton is not installed")
    dispatch._chosen.clear()
    assert dispatch.backend_for(torch.device("cuda")) == "torch"

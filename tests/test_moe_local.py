"""The FSSDPMoE layer on one process, the gate and the ops, against plain per-token references."""
import pytest
import torch
import torch.nn.functional as F

from ds_fssdp import FSSDPMoE, ops


def naive_moe(layer, x_TH):
    """Per token, per choice: probabilities, top-k, renormalised weights, the expert MLP."""
    probs = torch.softmax(x_TH.float() @ layer.gate.weight.float().t(), -1)
    scores = probs if layer.gate.expert_bias is None else probs + layer.gate.expert_bias
    out = torch.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        chosen = torch.topk(scores[t], layer.k).indices
        w = probs[t, chosen]
        if layer.k > 1 and layer.gate.normalize_topk:
            w = w / w.sum()
        for e, we in zip(chosen.tolist(), w):
            if layer.activation == "gelu":
                y = F.gelu(x_TH[t] @ layer.w_a[e]) @ layer.w_b[e]
            else:
                y = (F.silu(x_TH[t] @ layer.w_gate[e]) * (x_TH[t] @ layer.w_up[e])) @ layer.w_down[e]
            out[t] += we * y
    return out


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("k,normalize", [(1, True), (2, True), (2, False), (3, True)])
def test_layer_matches_naive(activation, k, normalize):
    torch.manual_seed(0)
    layer = FSSDPMoE(hidden_size=6, ffn_hidden_size=10, num_experts=5, k=k, activation=activation,
                     normalize_topk=normalize, init_std=0.5)
    x = torch.randn(3, 7, 6, requires_grad=True)
    out, l_aux, counts = layer(x)
    assert out.shape == x.shape and counts.sum() == 21 * k
    want = naive_moe(layer, x.reshape(-1, 6)).reshape(x.shape)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # Gradients against the naive version too.
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), [x, layer.gate.weight] + layer.expert_parameters())
    want_grads = torch.autograd.grad((want * g).sum(), [x, layer.gate.weight] + layer.expert_parameters())
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_aux_loss_and_z_loss():
    torch.manual_seed(1)
    layer = FSSDPMoE(hidden_size=4, ffn_hidden_size=4, num_experts=4, k=2, z_loss_coef=0.0)
    x = torch.randn(50, 4)
    g = layer.gate(x)
    probs = torch.softmax(x @ layer.gate.weight.t(), -1)
    frac = torch.bincount(g.idx_TK.flatten(), minlength=4).float() / 100
    torch.testing.assert_close(g.l_aux, 4 * (frac * probs.mean(0)).sum())
    layer.gate.z_loss_coef = 0.1
    z = torch.logsumexp(x @ layer.gate.weight.t(), -1).pow(2).mean()
    torch.testing.assert_close(layer.gate(x).l_aux, g.l_aux + 0.1 * z)
    # Perfectly uniform routing gives l_aux = 1.
    layer.gate.weight.data.zero_()
    layer.gate.z_loss_coef = 0.0
    uniform = layer.gate(torch.randn(40, 4))
    assert abs(uniform.l_aux.item() - 1.0) < 1e-6


def test_aux_free_bias_moves_selection_not_weights():
    torch.manual_seed(2)
    layer = FSSDPMoE(hidden_size=4, ffn_hidden_size=4, num_experts=4, k=1, aux_free_bias=True,
                     bias_update_rate=0.05)
    x = torch.randn(64, 4)
    layer.gate.expert_bias.copy_(torch.tensor([10.0, 0, 0, 0]))
    g = layer.gate(x)
    assert bool((g.idx_TK == 0).all()), "a large bias must win the selection"
    probs = torch.softmax(x @ layer.gate.weight.t(), -1)
    torch.testing.assert_close(g.weights_TK[:, 0], probs[:, 0]), "weights come from the probabilities"
    layer.gate.expert_bias.zero_()
    layer.train()
    layer(x)
    load = layer.pending_load_E.clone()
    layer.update_routing_bias()
    expected = 0.05 * torch.sign(load.mean() - load).float()
    torch.testing.assert_close(layer.gate.expert_bias, expected)
    assert layer.pending_load_E is None


def test_gate_bias_is_bound_like_an_hf_router_bias():
    """One routing-bias mechanism: the gate only reads its bias; the experts module's rule (the
    one HF routers' e_score_correction_bias are bound to) moves it, counting each forward's loads
    once, at the config's rate when the stage sets one; the binding follows a dtype move."""
    torch.manual_seed(3)
    layer = FSSDPMoE(hidden_size=4, ffn_hidden_size=4, num_experts=4, k=2, aux_free_bias=True, bias_update_rate=0.05)
    assert not hasattr(layer.gate, "update_bias") and not hasattr(layer.gate, "pending_load")
    assert layer.router_bias is layer.gate.expert_bias and layer.bias_update_rate == 0.05
    assert layer.pending_loads() == []
    layer.train()
    x = torch.randn(16, 4)
    _, _, counts = layer(x)
    assert [p.tolist() for p in layer.pending_loads()] == [counts.double().tolist()]  # counted once
    layer.router_bias_update_rate = 0.25  # what the FSSDP stage sets from fssdp.router_bias_update_rate
    layer.update_routing_bias()
    torch.testing.assert_close(layer.gate.expert_bias, 0.25 * torch.sign(counts.double().mean() - counts).float())
    layer.double()
    assert layer.router_bias is layer.gate.expert_bias and layer.router_bias.dtype == torch.float64
    layer(x.double())
    layer.update_routing_bias()
    assert not torch.equal(layer.gate.expert_bias, 0.25 * torch.sign(counts.double().mean() - counts))
    # A checkpoint from before carries the gate's old accumulator: it loads.
    state = dict(layer.state_dict(), **{"gate.pending_load": torch.zeros(4, dtype=torch.float64)})
    layer.load_state_dict(state)


def test_empty_input_and_export():
    layer = FSSDPMoE(hidden_size=4, ffn_hidden_size=6, num_experts=3, k=2, activation="swiglu")
    out, l_aux, counts = layer(torch.zeros(0, 4))
    assert out.shape == (0, 4) and l_aux.item() == 0.0 and counts.sum() == 0
    full = layer.export_experts()
    assert set(full) == {"w_gate", "w_up", "w_down"} and full["w_down"].shape == (3, 6, 4)
    assert all(torch.equal(getattr(layer, k), v) for k, v in full.items())


def test_constructor_errors():
    with pytest.raises(ValueError, match="activation"):
        FSSDPMoE(hidden_size=4, ffn_hidden_size=4, num_experts=4, activation="relu")
    with pytest.raises(ValueError, match="k \\(5\\)"):
        FSSDPMoE(hidden_size=4, ffn_hidden_size=4, num_experts=4, k=5)
    with pytest.raises(ValueError, match="hidden_size"):
        FSSDPMoE(hidden_size=4, ffn_hidden_size=4, num_experts=4)(torch.zeros(2, 5))


GROUPS = {
    "leading-empty": [0, 3, 2],
    "middle-empty": [2, 0, 3],
    "trailing-empty": [3, 2, 0],
    "one-row": [0, 1, 0],
    "all-in-one": [0, 0, 5],
    "all-empty": [0, 0, 0],
}


@pytest.mark.parametrize("name", list(GROUPS))
@pytest.mark.parametrize("trans_w", [False, True])
def test_grouped_gemm_edge_cases(name, trans_w):
    sizes = GROUPS[name]
    torch.manual_seed(3)
    x = torch.randn(sum(sizes), 4, requires_grad=True)
    w = torch.randn(3, 6, 4, requires_grad=True) if trans_w else torch.randn(3, 4, 6, requires_grad=True)
    y = ops.grouped_gemm(x, w, sizes, trans_w=trans_w)
    assert y.shape == (sum(sizes), 6)
    groups = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
    want = torch.stack([x[r] @ (w[g].t() if trans_w else w[g]) for r, g in enumerate(groups.tolist())]) \
        if sum(sizes) else torch.zeros(0, 6)
    torch.testing.assert_close(y, want)
    if sum(sizes):
        gy = torch.randn_like(y)
        gx, gw = torch.autograd.grad((y * gy).sum(), [x, w])
        wx, ww = torch.autograd.grad((want * gy).sum(), [x, w])
        torch.testing.assert_close(gx, wx)
        torch.testing.assert_close(gw, ww)


def test_grouped_gemm_checks_sizes():
    with pytest.raises(ValueError, match="group sizes sum"):
        ops.grouped_gemm(torch.zeros(3, 2), torch.zeros(2, 2, 2), [1, 1])
    with pytest.raises(ValueError, match="3 group sizes for 2 weights"):
        ops.grouped_gemm(torch.zeros(3, 2), torch.zeros(2, 2, 2), [1, 1, 1])


def test_combine_sums_in_k_order():
    """The layer's combine (ops.unpermute_combine, fed the route's unsend order) adds the k
    products left to right: 1e8 + 1 rounds to 1e8 in fp32, so k order gives 0 where (1 - 1e8) +
    1e8 or a pairwise sum would give 1."""
    y = torch.tensor([[1e8], [1.0], [-1e8], [2.0], [4.0], [8.0]])
    w = torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.25, 1.0]])
    out = ops.unpermute_combine(y, torch.arange(6).reshape(2, 3), w)
    assert out.tolist() == [[0.0], [10.0]]
    # The rows come in send order: unsend [2, 0, 1] reads row 2 first (-1e8 + 1e8 + 1 = 1).
    assert ops.unpermute_combine(y[:3], torch.tensor([[2, 0, 1]]), w[:1]).tolist() == [[1.0]]


def test_layer_with_biases_and_clamped_activation():
    """FSSDPMoE(bias=True, activation="gptoss"): biases start at zero and live in the expert's row;
    the layer equals a per-token loop over GPT-OSS's formula with the biases set."""
    torch.manual_seed(0)
    params = {"alpha": 1.702, "limit": 1.5}
    layer = FSSDPMoE(hidden_size=6, ffn_hidden_size=10, num_experts=4, k=2, activation="gptoss", bias=True,
                     act_params=params, init_std=0.8)
    assert all(torch.count_nonzero(getattr(layer, n)) == 0 for n in ("b_gate", "b_up", "b_down"))
    with torch.no_grad():
        for n in ("b_gate", "b_up", "b_down"):
            getattr(layer, n).normal_()
    x = torch.randn(9, 6)
    out, _, _ = layer(x)
    probs = torch.softmax(x @ layer.gate.weight.t(), -1)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = torch.topk(probs[t], 2).indices
        w = probs[t, chosen] / probs[t, chosen].sum()
        for e, we in zip(chosen.tolist(), w):
            g = (x[t] @ layer.w_gate[e] + layer.b_gate[e]).clamp(max=params["limit"])
            u = (x[t] @ layer.w_up[e] + layer.b_up[e]).clamp(-params["limit"], params["limit"])
            h = (u + 1) * g * torch.sigmoid(params["alpha"] * g)
            want[t] += we * (h @ layer.w_down[e] + layer.b_down[e])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)

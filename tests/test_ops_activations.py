"""The expert activations against transformers' own code, and a GPT-OSS experts module (biases,
interleaved gate/up, the clamped gate) against ``ops.expert_mlp`` on the same weights.

The activation formulas repeat transformers' operations in their order, so on the same input
tensors they are compared bitwise (fp32 and bf16). The whole-expert comparison goes through the grouped GEMM (another
summation order than HF's per-expert matmuls): fp32 at 1e-5 of the largest magnitude.
"""
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import _default_apply_gate  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts  # noqa: E402
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts  # noqa: E402
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402

from ds_fssdp import ops  # noqa: E402
from ds_fssdp.ops import activations  # noqa: E402

LIMIT, ALPHA = 7.0, 1.702


def _hf_gate(activation):
    """transformers' gate function for our activation: (callable on gate_up, interleaved?)."""
    if activation in ("swiglu", "geglu", "geglu_tanh"):
        act = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}[activation]
        return (lambda gu: _default_apply_gate(SimpleNamespace(act_fn=ACT2FN[act]), gu)), False
    if activation == "swiglu_limit":
        return (lambda gu: DeepseekV4Experts._apply_gate(SimpleNamespace(limit=LIMIT, act_fn=ACT2FN["silu"]), gu)), False
    assert activation == "gptoss"
    return (lambda gu: GptOssExperts._apply_gate(SimpleNamespace(limit=LIMIT, alpha=ALPHA), gu)), True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "geglu_tanh", "swiglu_limit", "gptoss"])
def test_gated_activations_equal_transformers_bitwise(activation, dtype):
    gen = torch.Generator().manual_seed(1)
    g, u = (6 * torch.randn(64, 40, generator=gen)).to(dtype), (6 * torch.randn(64, 40, generator=gen)).to(dtype)
    assert (g > LIMIT).any() and (u > LIMIT).any() and (u < -LIMIT).any()  # the clamps cut values
    hf, interleaved = _hf_gate(activation)
    gate_up = torch.stack([g, u], dim=-1).flatten(-2) if interleaved else torch.cat([g, u], dim=-1)
    params = activations.check(activation, {"swiglu_limit": {"limit": LIMIT},
                                            "gptoss": {"alpha": ALPHA, "limit": LIMIT}}.get(activation))
    # The same views HF slices: CPU kernels vectorize by memory layout, which changes the last bit.
    views = (gate_up[..., ::2], gate_up[..., 1::2]) if interleaved else gate_up.chunk(2, dim=-1)
    assert torch.equal(views[0], g) and torch.equal(views[1], u)
    assert torch.equal(activations.apply(activation, params, *views), hf(gate_up))


def test_swiglu_limit_equals_glm5_next_and_plain_activations_equal_act2fn():
    gen = torch.Generator().manual_seed(2)
    g, u = 6 * torch.randn(32, 24, generator=gen), 6 * torch.randn(32, 24, generator=gen)
    gate_up = torch.cat([g, u], dim=-1)
    glm = Glm5NextTextExperts._apply_gate(SimpleNamespace(swiglu_limit=LIMIT), gate_up)
    assert torch.equal(activations.apply("swiglu_limit", {"limit": LIMIT}, *gate_up.chunk(2, dim=-1)), glm)
    assert torch.equal(activations.apply("gelu", {}, g), ACT2FN["gelu"](g))
    assert torch.equal(activations.apply("relu2", {}, g), ACT2FN["relu2"](g))


def test_gpt_oss_experts_module_equals_expert_mlp():
    """HF's GptOssExperts (eager loop: x @ gate_up + bias, interleaved _apply_gate, down + bias)
    against expert_mlp('gptoss') with the gate/up columns de-interleaved into w_gate / w_up."""
    torch.manual_seed(3)
    E, H, Fh, T, K = 4, 16, 12, 10, 2
    config = GptOssConfig(hidden_size=H, intermediate_size=Fh, num_local_experts=E, num_experts_per_tok=K)
    hf = GptOssExperts(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=1.0)
    x_TH = torch.randn(T, H)
    idx_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    idx_TK[:, 0] = torch.where(idx_TK[:, 1] == 3, 0, 3)  # expert 3 busy, expert 1 or 2 may be empty
    w_TK = torch.rand(T, K)
    want_TH = hf(x_TH, idx_TK, w_TK)

    weights = {"w_gate": hf.gate_up_proj[..., ::2], "w_up": hf.gate_up_proj[..., 1::2], "w_down": hf.down_proj,
               "b_gate": hf.gate_up_proj_bias[:, ::2], "b_up": hf.gate_up_proj_bias[:, 1::2],
               "b_down": hf.down_proj_bias}
    order = torch.argsort(idx_TK.reshape(-1), stable=True)
    token_A = torch.arange(T).repeat_interleave(K)[order]
    sizes = torch.bincount(idx_TK.reshape(-1), minlength=E).tolist()
    y_AH = ops.expert_mlp(x_TH[token_A], weights, sizes, activation="gptoss",
                          act_params={"alpha": config.swiglu_alpha, "limit": config.swiglu_limit})
    got_TH = torch.zeros(T, H).index_add_(0, token_A, y_AH * w_TK.reshape(-1)[order, None])
    pre = x_TH @ hf.gate_up_proj[0].detach() + hf.gate_up_proj_bias[0].detach()
    assert (pre.abs() > config.swiglu_limit).any(), "the clamp must matter in this case"
    scale = want_TH.abs().max()
    assert (got_TH - want_TH).abs().max() <= 1e-5 * scale

    g_want = torch.autograd.grad(want_TH.square().sum(), list(hf.parameters()))
    g_got = torch.autograd.grad(got_TH.square().sum(), list(hf.parameters()))
    for (name, _), a, b in zip(hf.named_parameters(), g_got, g_want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name

"""The Triton kernels against torch references, on a named table of edge cases.

On the CPU the kernels run under the Triton interpreter in a subprocess: TRITON_INTERPRET=1 must
be set before the kernel modules are imported, and setting it in this process would change every
other test of the run. fp32 only here (the interpreter mis-computes bf16 arithmetic), and only
INTERPRET_CASES (the kernel paths; the interpreter is slow); tests/test_ops_gpu.py runs the whole
table, ALL_CASES, on CUDA in fp32, fp16 and bf16, and tests/test_ops_reference.py the torch one.

References are plain torch compositions in float64 on the CPU, from the same (rounded) inputs.
Tolerance: max |got - want| <= TOL[dtype] * max |want|. fp32 is tight (summation order only);
fp16 and bf16 sit at their rounding noise (half and bf16 eps ~ 1e-3 and 8e-3, plus rounded
intermediates in the expert MLP).
"""
import json
import os
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.distributed  # spawns ranks or launches processes

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# Group sizes. H 24 and F 20 are not multiples of the interpreter's 16-wide tiles; groups of 17
# and 33 rows leave partial row tiles; a group of 16 fills one exactly.
GEMM_CASES = {
    "leading-empty": [0, 17, 5],
    "middle-empty": [9, 0, 20],
    "trailing-empty": [18, 3, 0],
    "one-row": [0, 1, 0],
    "all-in-one": [0, 0, 37],
    "odd-sizes": [1, 15, 16, 17, 33],
    "single-group": [13],
    "balanced": [6, 6, 6],  # the torch path's single-bmm case
    "all-empty": [0, 0, 0],
    "no-groups": [],
}
GEMM_H, GEMM_F = 24, 20

# Permutation: tokens T, top-k K, the fraction of assignments dropped (no row; the runtime drops
# none, the kernels skip -1), and whether the combine has gate weights. The send order is random,
# as a route's is to the kernels.
PERMUTE_CASES = {
    "no-tokens": dict(T=0, K=2),
    "one-token": dict(T=1, K=2),
    "top-1": dict(T=7, K=1),
    "top-3": dict(T=11, K=3),
    "no-weights": dict(T=11, K=3, weighted=False),
    "dropped-assignments": dict(T=9, K=2, drop=0.3),
    "all-dropped": dict(T=5, K=2, drop=1.0),
}
PERMUTE_H = 40  # several 16-wide blocks under the interpreter, the last one partial

# Expert MLPs: each activation and the biases, over the same kinds of group sizes. LIMIT is
# small enough that both clamps of the limited activations cut real values (checked in check_mlp).
LIMIT, ALPHA = 1.0, 1.702
MLP_CASES = {
    "gelu": dict(sizes=[0, 7, 20], activation="gelu"),
    "swiglu": dict(sizes=[5, 0, 18], activation="swiglu"),
    "gelu-bias": dict(sizes=[3, 0, 9], activation="gelu", bias=True),
    "relu2": dict(sizes=[0, 5, 1], activation="relu2"),
    "swiglu-bias": dict(sizes=[0, 1, 0], activation="swiglu", bias=True),
    "geglu": dict(sizes=[4, 6, 0], activation="geglu"),
    "geglu_tanh-bias": dict(sizes=[0, 0, 11], activation="geglu_tanh", bias=True),
    "swiglu_limit": dict(sizes=[6, 0, 7], activation="swiglu_limit", act_params={"limit": LIMIT}),
    "gptoss-bias": dict(sizes=[2, 9, 1], activation="gptoss", bias=True,
                        act_params={"alpha": ALPHA, "limit": LIMIT}),
    # LoRA factors on every projection (ops/lora.py), rank 3: narrower than any tile.
    "swiglu-lora": dict(sizes=[0, 7, 20], activation="swiglu", lora_rank=3),
    "gelu-bias-lora": dict(sizes=[3, 0, 9], activation="gelu", bias=True, lora_rank=2),
}
# What the interpreter runs (it is slow per program instance): the activations are torch
# elementwise ops on every backend, so only the GEMM paths (plain, bias) need the kernels.
INTERPRET_MLP = ["gelu", "swiglu", "gptoss-bias", "swiglu-lora"]

ALL_CASES = ([f"gemm/{n}" for n in GEMM_CASES] + [f"gemm/{n}/trans_w" for n in GEMM_CASES]
             + [f"gemm/{n}/bias" for n in GEMM_CASES] + ["gemm/odd-sizes/trans_w/bias", "gemm/tensor-sizes"]
             + [f"permute/{n}" for n in PERMUTE_CASES]
             + ["permute/k-order"] + [f"mlp/{n}" for n in MLP_CASES] + ["backend"])
# The transposed bias case is the same epilogue as the plain one: the GPU and the torch tests run it.
INTERPRET_CASES = [c for c in ALL_CASES if (not c.startswith("mlp/") or c[4:] in INTERPRET_MLP)
                   and c != "gemm/odd-sizes/trans_w/bias"]


def assert_close_scaled(got, want, dtype, *, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel() == 0:
        return
    err = (got.detach().double().cpu() - want.detach().double().cpu()).abs().max().item()
    scale = want.abs().max().item()
    assert err <= TOL[dtype] * scale + 1e-300, f"{what}: max error {err:.3g} > {TOL[dtype]} * {scale:.3g}"


def _leaf(t, device, dtype):
    """(leaf on the device in dtype, float64 CPU leaf of the same rounded values)."""
    t = t.to(dtype)
    return t.to(device).requires_grad_(), t.double().requires_grad_()


def check_gemm(sizes, device, dtype, *, trans_w, bias=False, sizes_as_tensor=False):
    from ds_fssdp import ops

    gen = torch.Generator().manual_seed(len(sizes) * 7 + sum(sizes))
    G, R = len(sizes), sum(sizes)
    x, x64 = _leaf(torch.randn(R, GEMM_H, generator=gen), device, dtype)
    w_shape = (G, GEMM_F, GEMM_H) if trans_w else (G, GEMM_H, GEMM_F)
    w, w64 = _leaf(torch.randn(w_shape, generator=gen), device, dtype)
    # A bias of the products' magnitude (~sqrt(H)), so a wrong or missing one shows.
    b, b64 = _leaf(5 * torch.randn(G, GEMM_F, generator=gen), device, dtype) if bias else (None, None)
    dy = torch.randn(R, GEMM_F, generator=gen).to(dtype)
    group_sizes = torch.tensor(sizes, dtype=torch.long, device=device) if sizes_as_tensor else sizes
    y = ops.grouped_gemm(x, w, group_sizes, bias=b, trans_w=trans_w)
    assert y.requires_grad, "the result must stay tied to x and w in autograd"
    parts = [x64[s - n:s] @ (w64[g].t() if trans_w else w64[g]) + (b64[g] if bias else 0)
             for g, (n, s) in enumerate(zip(sizes, torch.tensor(sizes, dtype=torch.long).cumsum(0).tolist()))]
    want = torch.cat(parts) if parts else x64 @ x64.new_zeros(GEMM_H, GEMM_F)
    assert_close_scaled(y, want, dtype, what="y")
    leaves, leaves64 = ([x, w, b], [x64, w64, b64]) if bias else ([x, w], [x64, w64])
    got = torch.autograd.grad(y, leaves, dy.to(device))
    ref = torch.autograd.grad(want, leaves64, dy.double(), allow_unused=True)
    for name, a, r, leaf64 in zip(["dx", "dw", "dbias"], got, ref, leaves64):
        assert_close_scaled(a, torch.zeros_like(leaf64) if r is None else r, dtype, what=name)


def reference_activation(activation, params, *inputs):
    """The formulas written out (float64), apart from the code under test."""
    if activation == "gelu":
        (h,) = inputs
        return 0.5 * h * (1 + torch.erf(h / 2 ** 0.5))
    if activation == "relu2":
        (h,) = inputs
        return torch.where(h > 0, h * h, 0)
    g, u = inputs
    limit = params.get("limit")
    if activation == "swiglu":
        return g * torch.sigmoid(g) * u
    if activation == "geglu":
        return 0.5 * g * (1 + torch.erf(g / 2 ** 0.5)) * u
    if activation == "geglu_tanh":
        return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))) * u
    g, u = torch.minimum(g, torch.tensor(limit, dtype=g.dtype)), u.clamp(-limit, limit)
    if activation == "swiglu_limit":
        return g * torch.sigmoid(g) * u
    assert activation == "gptoss"
    return (u + 1) * g * torch.sigmoid(params["alpha"] * g)


def check_mlp(sizes, device, dtype, *, activation, bias=False, act_params=None, lora_rank=0):
    from ds_fssdp import ops
    from ds_fssdp.ops.lora import LoraFactors

    gen = torch.Generator().manual_seed(5)
    G, R, H, Fh = len(sizes), sum(sizes), GEMM_H, 32  # K = 32 in the down projection: EVEN_K
    x, x64 = _leaf(torch.randn(R, H, generator=gen), device, dtype)
    names = ops.ACTIVATIONS[activation]
    shapes = {n: (G, H, Fh) if side == "in" else (G, Fh, H) for n, side in names}
    if bias:
        shapes.update({"b" + n[1:]: (G, s[2]) for n, s in list(shapes.items())})
    pairs = {n: _leaf(0.3 * torch.randn(s, generator=gen), device, dtype) for n, s in shapes.items()}
    weights = {n: p[0] for n, p in pairs.items()}
    lora, scaling = {}, 0.7
    for n in (shapes if lora_rank else ()):
        if n.startswith("w"):
            _, fan_in, fan_out = shapes[n]
            pairs[f"{n}.A"] = _leaf(0.3 * torch.randn(G, fan_in, lora_rank, generator=gen), device, dtype)
            pairs[f"{n}.B"] = _leaf(0.3 * torch.randn(G, lora_rank, fan_out, generator=gen), device, dtype)
            lora[n] = [LoraFactors(pairs[f"{n}.A"][0], pairs[f"{n}.B"][0], scaling)]
    y = ops.expert_mlp(x, weights, sizes, activation=activation, act_params=act_params, lora=lora or None)
    w64 = {n: p[1] for n, p in pairs.items()}

    def lin(inp, name, g):
        out = inp @ w64[name][g] + (w64["b" + name[1:]][g] if bias else 0)
        return out + scaling * (inp @ w64[f"{name}.A"][g]) @ w64[f"{name}.B"][g] if name in lora else out

    outs, gates, ups, start = [], [], [], 0
    for g, n in enumerate(sizes):
        xg = x64[start:start + n]
        if activation in ("gelu", "relu2"):
            outs.append(lin(reference_activation(activation, {}, lin(xg, "w_a", g)), "w_b", g))
        else:
            gate, up = lin(xg, "w_gate", g), lin(xg, "w_up", g)
            gates.append(gate)
            ups.append(up)
            outs.append(lin(reference_activation(activation, act_params or {}, gate, up), "w_down", g))
        start += n
    want = torch.cat(outs)
    if act_params and "limit" in act_params:  # the case must exercise all three clamps
        limit, gate, up = act_params["limit"], torch.cat(gates), torch.cat(ups)
        assert (gate > limit).any() and (up > limit).any() and (up < -limit).any()
    assert_close_scaled(y, want, dtype, what="y")
    dy = torch.randn(R, H, generator=gen).to(dtype)
    got = torch.autograd.grad(y, [x] + [p[0] for p in pairs.values()], dy.to(device))
    ref = torch.autograd.grad(want, [x64] + [p[1] for p in pairs.values()], dy.double())
    for name, a, b in zip(["dx"] + list(pairs), got, ref):
        assert_close_scaled(a, b, dtype, what=name)


def send_layout(T, K, *, gen, drop=0.0):
    """(token_S, rows_TK): a random send order of the kept assignments, and each assignment's row
    in it (-1 for a dropped one)."""
    kept_A = torch.nonzero(torch.rand(T * K, generator=gen) >= drop).flatten()
    order_S = kept_A[torch.randperm(kept_A.numel(), generator=gen)]
    rows_A = torch.full((T * K,), -1, dtype=torch.long)
    rows_A[order_S] = torch.arange(order_S.numel())
    return order_S // max(K, 1), rows_A.reshape(T, K)


def check_permute(spec, device, dtype):
    from ds_fssdp import ops

    T, K = spec["T"], spec["K"]
    gen = torch.Generator().manual_seed(T * 31 + K)
    token_S, rows_TK = send_layout(T, K, gen=gen, drop=spec.get("drop", 0.0))
    S = token_S.numel()

    # permute_tokens: exact gather; backward sums each token's rows (given rows_TK lazily, as the
    # runtime does).
    x, x64 = _leaf(torch.randn(T, PERMUTE_H, generator=gen), device, dtype)
    rows = ops.permute_tokens(x, token_S.to(device), lambda: rows_TK.to(device))
    assert rows.requires_grad and rows.shape == (S, PERMUTE_H)
    assert torch.equal(rows.detach().cpu(), x.detach().cpu()[token_S]), "gather must copy rows exactly"
    g = torch.randn(S, PERMUTE_H, generator=gen).to(dtype)
    (gx,) = torch.autograd.grad(rows, [x], g.to(device))
    (wx,) = torch.autograd.grad(x64.index_select(0, token_S), [x64], g.double())
    assert_close_scaled(gx, wx, dtype, what="permute_tokens dx")

    # unpermute_combine of the returned rows, with gate weights or without.
    weighted = spec.get("weighted", True)
    y, y64 = _leaf(torch.randn(S, PERMUTE_H, generator=gen), device, dtype)
    w, w64 = _leaf(torch.rand(T, K, generator=gen), device, torch.float32) if weighted else (None, None)
    out = ops.unpermute_combine(y, rows_TK.to(device), w)
    want = x64.new_zeros(T, PERMUTE_H)
    y64_padded = torch.cat([y64, y64.new_zeros(1, PERMUTE_H)])  # row S: zeros, for the dropped ones
    for k in range(K):
        part = y64_padded.index_select(0, torch.where(rows_TK[:, k] >= 0, rows_TK[:, k], S))
        want = want + (part * w64[:, k:k + 1] if weighted else part)
    assert out.dtype == dtype
    assert_close_scaled(out, want, dtype, what="unpermute_combine")
    gout = torch.randn(T, PERMUTE_H, generator=gen).to(dtype)
    leaves, leaves64 = ([y, w], [y64, w64]) if weighted else ([y], [y64])
    got = torch.autograd.grad(out, leaves, gout.to(device))
    ref = torch.autograd.grad(want, leaves64, gout.double(), allow_unused=True)
    for name, a, b in zip(["dy", "dweights"], got, ref):
        assert_close_scaled(a, torch.zeros_like(leaves64[0]) if b is None else b,
                            dtype if name == "dy" else torch.float32, what=f"unpermute_combine {name}")


def check_k_order(device):
    """The combine adds the k products left to right, in fp32: 1e8 + 1 rounds to 1e8, so k order
    gives 0 where another order would give 1; the send order does not matter, k order does."""
    from ds_fssdp import ops

    y = torch.tensor([[1.0], [-1e8], [1e8]]).expand(3, PERMUTE_H).contiguous().to(device)
    out = ops.unpermute_combine(y, torch.tensor([[2, 0, 1]], device=device), torch.ones(1, 3, device=device))
    assert out.cpu().eq(0).all(), out
    out = ops.unpermute_combine(y, torch.tensor([[1, 2, 0]], device=device), torch.ones(1, 3, device=device))
    assert out.cpu().eq(1).all(), out


def run_case(name, device, dtype):
    """Raise AssertionError if case ``name`` fails on ``device`` in ``dtype``."""
    kind, _, rest = name.partition("/")
    if kind == "gemm":
        if rest == "tensor-sizes":
            return check_gemm([4, 0, 19], device, dtype, trans_w=False, sizes_as_tensor=True)
        edge, *flags = rest.split("/")
        return check_gemm(GEMM_CASES[edge], device, dtype, trans_w="trans_w" in flags, bias="bias" in flags)
    if kind == "permute":
        return check_k_order(device) if rest == "k-order" else check_permute(PERMUTE_CASES[rest], device, dtype)
    if kind == "mlp":
        case = MLP_CASES[rest]
        return check_mlp(case["sizes"], device, dtype, activation=case["activation"], bias=case.get("bias", False),
                         act_params=case.get("act_params"), lora_rank=case.get("lora_rank", 0))
    if kind == "backend":
        from ds_fssdp.ops.dispatch import backend_for
        assert backend_for(torch.device(device)) == "triton", "these cases must run the Triton kernels"
        return None
    raise KeyError(name)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    pytest.importorskip("triton", reason="the Triton interpreter tests need triton (pip install triton)")
    out = tmp_path_factory.mktemp("triton_interpret") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", DS_FSSDP_OPS_BACKEND="triton")
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and out.exists(), f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", INTERPRET_CASES)
def test_triton_kernel_under_interpreter(interpreter_results, name):
    result = interpreter_results["cases"][name]
    assert result == "ok", result


def _worker(out_path):
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker runs the kernels under the interpreter"
    results, started = {}, time.perf_counter()
    for name in INTERPRET_CASES:
        try:
            run_case(name, "cpu", torch.float32)
            results[name] = "ok"
        except Exception:  # reported per case to the parent test, not swallowed
            results[name] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump({"cases": results, "seconds": time.perf_counter() - started}, f)


if __name__ == "__main__":
    _worker(sys.argv[1])

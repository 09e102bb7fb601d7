"""The Triton kernels on a CUDA device: the interpreter's edge-case table in fp32, fp16 and bf16,
larger shapes that run the autotuned GPU tile configs, and no host syncs on the device path.

Skipped without a GPU (marker ``gpu``). References are float64 on the same device, from the same
rounded inputs; tolerances as in test_ops_triton_interpret.py (TOL per dtype, relative to the
largest magnitude).
"""
import pytest
import torch

from test_ops_triton_interpret import ALL_CASES, assert_close_scaled, run_case

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PER_DTYPE_CASES = [c for c in ALL_CASES if c not in ("backend", "permute/k-order")]


def test_cuda_tensors_run_triton():
    from ds_fssdp.ops.dispatch import backend_for

    assert backend_for(torch.device("cuda")) == "triton"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", PER_DTYPE_CASES)
def test_edge_case_table_on_gpu(name, dtype):
    run_case(name, "cuda", DTYPES[dtype])


@pytest.mark.parametrize("name", ["backend", "permute/k-order"])
def test_fp32_cases_on_gpu(name):
    run_case(name, "cuda", torch.float32)


def skewed_sizes(R, G, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(G, generator=gen) ** 3
    p[torch.randperm(G, generator=gen)[:G // 4]] = 0  # a quarter of the groups empty
    sizes = torch.floor(R * p / p.sum()).long()
    sizes[int(sizes.argmax())] += R - int(sizes.sum())
    return sizes


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("trans_w", [False, True], ids=["w", "w_T"])
@pytest.mark.parametrize("G,R,H,F", [(8, 3000, 512, 1408), (64, 4099, 384, 256)], ids=["few-groups", "many-groups"])
def test_grouped_gemm_large(G, R, H, F, trans_w, bias, dtype):
    from ds_fssdp import ops

    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(G + R)
    sizes = skewed_sizes(R, G, G).cuda()
    x = torch.randn(R, H, generator=gen).to("cuda", dtype).requires_grad_()
    w = (torch.randn((G, F, H) if trans_w else (G, H, F), generator=gen) * H ** -0.5).to("cuda", dtype).requires_grad_()
    b = torch.randn(G, F, generator=gen).to("cuda", dtype).requires_grad_() if bias else None
    dy = torch.randn(R, F, generator=gen).to("cuda", dtype)
    y = ops.grouped_gemm(x, w, sizes, bias=b, trans_w=trans_w)
    leaves = [x, w, b] if bias else [x, w]
    got = torch.autograd.grad(y, leaves, dy)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, w64 = leaves64[:2]
    parts, start = [], 0
    for g, n in enumerate(sizes.tolist()):
        parts.append(x64[start:start + n] @ (w64[g].t() if trans_w else w64[g]) + (leaves64[2][g] if bias else 0))
        start += n
    want = torch.cat(parts)
    ref = torch.autograd.grad(want, leaves64, dy.double(), allow_unused=True)
    for name, a, r, leaf64 in zip(["dx", "dw", "dbias"], got, ref, leaves64):
        assert_close_scaled(a, torch.zeros_like(leaf64) if r is None else r, dtype, what=name)
    assert_close_scaled(y, want, dtype, what="y")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_permutation_large(dtype):
    from ds_fssdp import ops

    dtype = DTYPES[dtype]
    T, K, E, D, H = 2048, 8, 64, 8, 2048
    gen = torch.Generator().manual_seed(3)
    idx = torch.argsort(torch.rand(T, E, generator=gen), 1)[:, :K].cuda()
    # The runtime's send order: destination (expert e lives on rank e * D // E), expert, token.
    send_A = torch.sort((idx * D // E * E + idx).reshape(-1) * T + torch.arange(T, device="cuda").repeat_interleave(K),
                        stable=True).indices
    token_S, rows_TK = send_A // K, torch.empty_like(send_A)
    rows_TK[send_A] = torch.arange(T * K, device="cuda")
    rows_TK = rows_TK.reshape(T, K)
    x = torch.randn(T, H, generator=gen).to("cuda", dtype).requires_grad_()
    rows = ops.permute_tokens(x, token_S, rows_TK)
    assert torch.equal(rows, x.detach()[token_S])
    w = torch.rand(T, K, generator=gen).cuda().requires_grad_()
    out = ops.unpermute_combine(rows * 2, rows_TK, w)
    want = 2 * x.detach().double() * w.detach().double().sum(1, keepdim=True)
    assert_close_scaled(out, want, dtype, what="round trip")
    g = torch.randn(T, H, generator=gen).to("cuda", dtype)
    gx, gw = torch.autograd.grad(out, [x, w], g)
    assert_close_scaled(gx, 2 * g.double() * w.detach().double().sum(1, keepdim=True), dtype, what="dx")
    want_gw = 2 * (g.double() * x.detach().double()).sum(1, keepdim=True).expand(T, K)
    assert_close_scaled(gw, want_gw, dtype, what="dweights")


def test_device_path_makes_no_host_sync():
    """Group sizes as a CUDA tensor: the grouped GEMM and permutation ops never wait on the host."""
    from ds_fssdp import ops

    sizes = torch.tensor([0, 300, 5, 0, 211], device="cuda")
    x = torch.randn(516, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5, 256, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = {"w_gate": w, "w_up": w.detach().clone().requires_grad_(), "w_down": torch.randn(
        5, 384, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)}
    # Biases too: the epilogue and the per-group row sum read the same device offsets.
    weights.update({"b_gate": torch.randn(5, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                    "b_down": torch.randn(5, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)})
    rows_TK = torch.randperm(516, device="cuda").reshape(258, 2)
    gate_TK = torch.rand(258, 2, device="cuda", requires_grad=True)

    def step():
        y = ops.expert_mlp(x, weights, sizes, activation="gptoss", act_params={"alpha": 1.702, "limit": 7.0})
        ops.unpermute_combine(y, rows_TK, gate_TK).float().sum().backward()

    step()  # autotuning (it times candidates, which syncs) happens on the first call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

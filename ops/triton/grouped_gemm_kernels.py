"""Triton kernels for the grouped GEMM: the grouped product (forward and input gradient, with an
optional per-group bias in its epilogue), the per-group weight gradient, and the per-group row sum
(the bias gradient).

Legend: R rows, G groups, K reduction features, N out features, M rows of one dw[g].

Group sizes and row offsets stay on the device (int32): no host sync. The grouped product's grid
is an upper bound on its row tiles, cdiv(R, BLOCK_M) + G (each group adds at most one partial
tile); a program past the last real tile does nothing. Weights are read through strides, so
``trans_w`` and non-contiguous views (experts sliced out of flat rows) cost no copy.

Under TRITON_INTERPRET=1 (CPU tests) one small fixed config runs, bf16 tiles are upcast to fp32
(the interpreter mis-computes bf16 arithmetic), and autotuning is off (it needs a GPU).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def grouped_mm_kernel(x_ptr, w_ptr, y_ptr, bias_ptr, sizes_ptr, offsets_ptr, R, N, K, G,
                      stride_xr, stride_xk, stride_wg, stride_wk, stride_wn, stride_yr, stride_yn,
                      stride_bg, stride_bn, ROWS_BUCKET, G_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """y_RN[rows of g] = x_RK[rows of g] @ w_GKN[g] (+ bias_GN[g] if HAS_BIAS, added to the fp32
    accumulator before the one rounding to y's dtype).

    sizes_G (int32) rows per group, offsets_G1 (int32) = [0, cumsum(sizes)]. Grid:
    ((cdiv(R, BLOCK_M) + G) * cdiv(N, BLOCK_N),); ROWS_BUCKET is only an autotune key; EVEN_K
    (K % BLOCK_K == 0) drops the K mask from the inner loop.
    Example, BLOCK_M 2: sizes [3, 0, 1] -> row tiles [g0 rows 0-1], [g0 row 2], [g2 row 3];
    programs for tiles 3.. (the bound is cdiv(4, 2) + 3 = 5) return without work.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.num_programs(0) // num_n
    # Grouped ordering: GROUP_M row tiles share each weight tile while it is in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    tile_m = first_m + (pid % width) % rows_here
    tile_n = (pid % width) // rows_here

    offs_g = tl.arange(0, G_POW2)
    sizes = tl.load(sizes_ptr + offs_g, mask=offs_g < G, other=0)
    tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    if tile_m < tl.sum(tiles, 0):
        # The group holding this tile: the number of groups whose tiles end at or before it.
        g = tl.sum((tile_end <= tile_m).to(tl.int32), 0)
        first_tile = tl.sum(tl.where(offs_g < g, tiles, 0), 0)
        row0 = tl.load(offsets_ptr + g) + (tile_m - first_tile) * BLOCK_M
        row_end = tl.minimum(tl.load(offsets_ptr + g + 1), R)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < row_end
        mask_n = offs_n < N
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xr + offs_k[None, :] * stride_xk
        w_ptrs = (w_ptr + g.to(tl.int64) * stride_wg + offs_k[:, None] * stride_wk
                  + offs_n[None, :] * stride_wn)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = offs_k < K - k0
                a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias = tl.load(bias_ptr + g.to(tl.int64) * stride_bg + offs_n * stride_bn, mask=mask_n, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yr + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def grouped_wgrad_kernel(a_ptr, b_ptr, out_ptr, offsets_ptr, R, M, N,
                         stride_ar, stride_am, stride_br, stride_bn, stride_og, stride_om, stride_on,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """out_GMN[g] = a_RM[rows of g].T @ b_RN[rows of g]; an empty group gets zeros.

    offsets_G1 (int32) = [0, cumsum(sizes)]. Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), G).
    Example: offsets [0, 2, 2, 3], a = x, b = dy -> out[0] = x[0:2].T @ dy[0:2], out[1] = 0,
    out[2] = x[2:3].T @ dy[2:3].
    """
    pid = tl.program_id(0)
    g = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    row0 = tl.load(offsets_ptr + g)
    row_end = tl.minimum(tl.load(offsets_ptr + g + 1), R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(row0, row_end, BLOCK_K):
        rows = r0 + offs_k
        mask_r = rows < row_end
        rows64 = rows.to(tl.int64)
        a = tl.load(a_ptr + rows64[None, :] * stride_ar + offs_m[:, None] * stride_am,
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptr + rows64[:, None] * stride_br + offs_n[None, :] * stride_bn,
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out_ptrs = (out_ptr + g.to(tl.int64) * stride_og + offs_m[:, None] * stride_om
                + offs_n[None, :] * stride_on)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def group_sum_kernel(dy_ptr, out_ptr, offsets_ptr, R, N, stride_dr, stride_dn, stride_og, stride_on,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """out_GN[g] = the sum of dy_RN's rows of group g (fp32 accumulation); an empty group gets zeros.

    offsets_G1 (int32) = [0, cumsum(sizes)]. Grid: (cdiv(N, BLOCK_N), G).
    Example: offsets [0, 2, 2, 3] -> out[0] = dy[0] + dy[1], out[1] = 0, out[2] = dy[2].
    """
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    mask_n = offs_n < N
    row0 = tl.load(offsets_ptr + g)
    row_end = tl.minimum(tl.load(offsets_ptr + g + 1), R)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(row0, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        tile = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * stride_dr + offs_n[None, :] * stride_dn,
                       mask=(rows < row_end)[:, None] & mask_n[None, :], other=0.0)
        acc += tl.sum(tile.to(tl.float32), 0)
    tl.store(out_ptr + g.to(tl.int64) * stride_og + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=mask_n)


def _config(bm, bn, bk, warps, stages, **extra):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **extra), num_warps=warps, num_stages=stages)


# Autotuned for 16-bit inputs on large problems only: Hopper-sized tiles (wgmma wants 64-row
# multiples per warp group). Each config costs a compile, so the list stays short.
MM_CONFIGS = [
    _config(128, 256, 64, 8, 3, GROUP_M=8),
    _config(128, 128, 64, 8, 4, GROUP_M=8),
    _config(128, 128, 64, 4, 4, GROUP_M=8),
    _config(64, 256, 64, 4, 4, GROUP_M=8),
    _config(64, 128, 64, 4, 4, GROUP_M=8),
]
WGRAD_CONFIGS = [
    _config(128, 256, 64, 8, 3),
    _config(128, 128, 64, 8, 4),
    _config(128, 128, 64, 4, 4),
    _config(64, 128, 64, 4, 4),
]
# One fixed config for fp32 and for small problems (below TUNE_MACS multiply-adds), where timing
# candidates would cost more than it saves; and one for the interpreter (no GPU to time on).
TUNE_MACS = 1 << 27
FIXED_MM = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
FIXED_WGRAD = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
INTERPRET_MM = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
INTERPRET_WGRAD = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
# The row sum is memory-bound and small next to the GEMMs: one fixed config, no tuning.
GROUP_SUM = dict(BLOCK_R=16, BLOCK_N=16) if INTERPRET else dict(BLOCK_R=32, BLOCK_N=128, num_warps=4)

_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
_mm_plain, _wgrad_plain = _even_k(grouped_mm_kernel), grouped_wgrad_kernel
if not INTERPRET:
    _mm_tuned = triton.autotune(configs=MM_CONFIGS, key=["N", "K", "ROWS_BUCKET"])(_mm_plain)
    _wgrad_tuned = triton.autotune(configs=WGRAD_CONFIGS, key=["M", "N"])(grouped_wgrad_kernel)


def _launcher(kind: str, dtype: torch.dtype, macs: int) -> tuple:
    """(kernel, launch meta): fixed configs under the interpreter, for fp32 and small problems, and
    under torch's deterministic mode (the autotuner picks tiles and warps by timing, so the kernel
    a run uses may differ from the last run's; one fixed config is one summation order)."""
    if INTERPRET:
        return (_mm_plain, INTERPRET_MM) if kind == "mm" else (_wgrad_plain, INTERPRET_WGRAD)
    if dtype == torch.float32 or macs < TUNE_MACS or torch.are_deterministic_algorithms_enabled():
        return (_mm_plain, FIXED_MM) if kind == "mm" else (_wgrad_plain, FIXED_WGRAD)
    return (_mm_tuned, {}) if kind == "mm" else (_wgrad_tuned, {})


def _flags(dtype: torch.dtype) -> dict:
    # The precision only matters for fp32 inputs, which follow torch's own matmul setting (full
    # precision unless the user allows TF32); 16-bit inputs keep Triton's default ("tf32").
    if INTERPRET:
        precision = "ieee"
    elif dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        precision = "tf32"
    return dict(UPCAST=INTERPRET and dtype == torch.bfloat16, PRECISION=precision)


def gemm(x_RK: torch.Tensor, w_GKN: torch.Tensor, sizes, *, trans_w: bool,
         bias_GF: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y_RN = grouped x_RK @ w[g] (+ bias_GF[g]) (w given as [G, N, K] and read transposed if
    ``trans_w``); ``sizes``: a ``GroupSizes``."""
    sizes_G, offsets_G1 = sizes.sizes_and_offsets(x_RK.device)
    R, K = x_RK.shape
    G = w_GKN.shape[0]
    N = w_GKN.shape[1] if trans_w else w_GKN.shape[2]
    stride_wk, stride_wn = (w_GKN.stride(2), w_GKN.stride(1)) if trans_w else (w_GKN.stride(1), w_GKN.stride(2))
    y_RN = x_RK.new_empty(R, N)
    if R == 0 or N == 0 or G == 0:
        return y_RN
    if K == 0 and bias_GF is None:
        return y_RN.zero_()
    kernel, meta = _launcher("mm", x_RK.dtype, R * N * K)

    def grid(META):
        return ((triton.cdiv(R, META["BLOCK_M"]) + G) * triton.cdiv(N, META["BLOCK_N"]),)

    # Without a bias, y stands in for its pointer (never read: HAS_BIAS prunes the load).
    bias, stride_bg, stride_bn = (y_RN, 0, 0) if bias_GF is None else (bias_GF, *bias_GF.stride())
    kernel[grid](x_RK, w_GKN, y_RN, bias, sizes_G, offsets_G1, R, N, K, G,
                 x_RK.stride(0), x_RK.stride(1), w_GKN.stride(0), stride_wk, stride_wn, y_RN.stride(0),
                 y_RN.stride(1), stride_bg, stride_bn, min(triton.next_power_of_2(max(R // G, 1)), 4096),
                 G_POW2=triton.next_power_of_2(G), HAS_BIAS=bias_GF is not None, **_flags(x_RK.dtype), **meta)
    return y_RN


def wgrad(x_RH: torch.Tensor, dy_RF: torch.Tensor, sizes, *, trans_w: bool) -> torch.Tensor:
    """dw[g] = x_g.T @ dy_g ([G, H, F]); with ``trans_w`` dy_g.T @ x_g ([G, F, H])."""
    offsets_G1 = sizes.sizes_and_offsets(x_RH.device)[1]
    a_RM, b_RN = (dy_RF, x_RH) if trans_w else (x_RH, dy_RF)
    G = offsets_G1.numel() - 1
    R, M, N = a_RM.shape[0], a_RM.shape[1], b_RN.shape[1]
    out_GMN = x_RH.new_empty(G, M, N)
    if G == 0 or M == 0 or N == 0:
        return out_GMN
    kernel, meta = _launcher("wgrad", x_RH.dtype, R * M * N)

    def grid(META):
        return (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]), G)

    kernel[grid](a_RM, b_RN, out_GMN, offsets_G1, R, M, N, a_RM.stride(0), a_RM.stride(1), b_RN.stride(0),
                 b_RN.stride(1), out_GMN.stride(0), out_GMN.stride(1), out_GMN.stride(2),
                 **_flags(x_RH.dtype), **meta)
    return out_GMN


def group_sum(dy_RN: torch.Tensor, sizes) -> torch.Tensor:
    """out_GN[g] = sum of dy_RN's rows of group g (zeros for an empty group)."""
    offsets_G1 = sizes.sizes_and_offsets(dy_RN.device)[1]
    G, (R, N) = offsets_G1.numel() - 1, dy_RN.shape
    out_GN = dy_RN.new_empty(G, N)
    if G == 0 or N == 0:
        return out_GN
    meta = dict(GROUP_SUM)
    group_sum_kernel[(triton.cdiv(N, meta["BLOCK_N"]), G)](
        dy_RN, out_GN, offsets_G1, R, N, dy_RN.stride(0), dy_RN.stride(1), out_GN.stride(0), out_GN.stride(1), **meta)
    return out_GN

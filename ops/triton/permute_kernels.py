"""Triton kernels for token permutation (``ops/permute.py``): the row gather that builds a send
buffer, the fused unpermute + top-k combine of the exchange's return, and its backward.

Legend: T tokens, K top-k, A = T * K assignments, N source rows, M gathered rows, R rows of an
expert-output buffer, H hidden.

Memory-bound: each program moves whole rows (BLOCK_H columns per step); a row index of -1 means
"no row" (gather writes zeros, combine skips it). Sums run in k order in fp32 (fp64 for fp64
inputs), so results are deterministic: no atomics. Under TRITON_INTERPRET=1 one small fixed
config runs and autotuning is off (it needs a GPU).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def gather_kernel(src_ptr, index_ptr, out_ptr, H, stride_src, stride_out, BLOCK_H: tl.constexpr):
    """out_MH[m] = src_NH[index_M[m]], zeros where index_M[m] == -1. Grid (M, cdiv(H, BLOCK_H)).

    Example: src [[1, 2], [3, 4], [5, 6]], index [2, 0, -1, 2] -> [[5, 6], [1, 2], [0, 0], [5, 6]].
    """
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    i = tl.load(index_ptr + m)
    # "offs < limit" rather than "mask & (i >= 0)": the interpreter rejects a vector & scalar mask.
    limit = tl.where(i >= 0, H, 0)
    row = tl.load(src_ptr + tl.maximum(i, 0).to(tl.int64) * stride_src + offs, mask=offs < limit, other=0.0)
    tl.store(out_ptr + m.to(tl.int64) * stride_out + offs, row, mask=mask)


@triton.jit
def combine_kernel(src_ptr, rows_ptr, weights_ptr, out_ptr, H, K, stride_src, stride_out,
                   HAS_WEIGHTS: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    """out_TH[t] = sum_k weights_TK[t, k] * src_RH[rows_TK[t, k]] in k order, skipping rows -1
    (weight 1 without weights). Grid (T, cdiv(H, BLOCK_H)).

    Example: src [[1, 1], [2, 2], [4, 4]], rows [[2, 0], [1, -1]], weights [[0.5, 1], [3, 9]]
    -> [[3, 3], [6, 6]].
    """
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=ACC)
    for k in range(K):
        r = tl.load(rows_ptr + t * K + k)
        v = tl.load(src_ptr + tl.maximum(r, 0).to(tl.int64) * stride_src + offs,
                    mask=offs < tl.where(r >= 0, H, 0), other=0.0).to(ACC)
        if HAS_WEIGHTS:
            v = v * tl.load(weights_ptr + t * K + k).to(ACC)
        acc += v
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def combine_backward_kernel(gout_ptr, assign_ptr, weights_ptr, y_ptr, gy_ptr, gw_ptr, H, K,
                            stride_gout, stride_y, stride_gy, HAS_WEIGHTS: tl.constexpr,
                            ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    """For each row r of assignment a = assign_R[r] (token a // K), -1 for none. Grid (R,).
        gy_RH[r] = weights_A[a] * gout_TH[a // K]      (zeros for a = -1)
        gw_A[a]  = <gout_TH[a // K], y_RH[r]>          (only with weights; gw_A preset to 0)
    Example, K 2: gout [[1, 2]], assign [1, 0], weights [0.5, 2], y [[1, 1], [3, 0]]
    -> gy [[2, 4], [0.5, 1]], gw [3, 3].
    """
    r = tl.program_id(0)
    a = tl.load(assign_ptr + r)
    valid = a >= 0
    limit = tl.where(valid, H, 0)
    a = tl.maximum(a, 0)
    t = (a // K).to(tl.int64)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + a, mask=valid, other=0.0).to(ACC)
        dot = tl.zeros((BLOCK_H,), dtype=ACC)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        mask = offs < H
        g = tl.load(gout_ptr + t * stride_gout + offs, mask=offs < limit, other=0.0).to(ACC)
        if HAS_WEIGHTS:
            tl.store(gy_ptr + r.to(tl.int64) * stride_gy + offs, (g * w).to(gy_ptr.dtype.element_ty), mask=mask)
            y = tl.load(y_ptr + r.to(tl.int64) * stride_y + offs, mask=mask, other=0.0).to(ACC)
            dot += g * y
        else:
            tl.store(gy_ptr + r.to(tl.int64) * stride_gy + offs, g.to(gy_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHTS:
        tl.store(gw_ptr + a, tl.sum(dot, 0).to(gw_ptr.dtype.element_ty), mask=valid)


def _row_configs():
    return [triton.Config(dict(BLOCK_H=b), num_warps=w) for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8))]


INTERPRET_BLOCK_H = 16  # small, so test rows span several blocks
TUNE_H = 1024  # narrower rows take one fixed block (timing candidates would cost more than it saves)

if not INTERPRET:
    _gather_tuned = triton.autotune(configs=_row_configs(), key=["H"])(gather_kernel)
    _combine_tuned = triton.autotune(configs=_row_configs(), key=["H", "K", "HAS_WEIGHTS"])(combine_kernel)
    _combine_bwd_tuned = triton.autotune(configs=_row_configs(), key=["H", "K", "HAS_WEIGHTS"])(
        combine_backward_kernel)


def _launcher(name: str, H: int) -> tuple:
    """(kernel, launch meta) for rows of H elements."""
    plain = {"gather": gather_kernel, "combine": combine_kernel, "combine_bwd": combine_backward_kernel}[name]
    if INTERPRET:
        return plain, dict(BLOCK_H=INTERPRET_BLOCK_H)
    if H < TUNE_H:
        block = max(triton.next_power_of_2(H), 32)
        return plain, dict(BLOCK_H=block, num_warps=max(1, min(4, block // 256)))
    tuned = {"gather": _gather_tuned, "combine": _combine_tuned, "combine_bwd": _combine_bwd_tuned}[name]
    return tuned, {}


def _acc(*dtypes) -> tl.dtype:
    return tl.float64 if torch.float64 in dtypes else tl.float32


def gather(src_NH: torch.Tensor, index_M: torch.Tensor) -> torch.Tensor:
    src_NH = _rows_contiguous(src_NH)
    H = src_NH.shape[1]
    out_MH = src_NH.new_empty(index_M.shape[0], H)
    if out_MH.numel():
        kernel, meta = _launcher("gather", H)
        kernel[lambda META: (index_M.shape[0], triton.cdiv(H, META["BLOCK_H"]))](
            src_NH, index_M.contiguous(), out_MH, H, src_NH.stride(0), out_MH.stride(0), **meta)
    return out_MH


def combine(src_RH: torch.Tensor, rows_TK: torch.Tensor, weights_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    src_RH = _rows_contiguous(src_RH)
    (T, K), H = rows_TK.shape, src_RH.shape[1]
    out_TH = src_RH.new_empty(T, H)
    if out_TH.numel():
        acc = _acc(src_RH.dtype, *(() if weights_TK is None else (weights_TK.dtype,)))
        kernel, meta = _launcher("combine", H)
        kernel[lambda META: (T, triton.cdiv(H, META["BLOCK_H"]))](
            src_RH, rows_TK.contiguous(), rows_TK if weights_TK is None else weights_TK.contiguous(), out_TH,
            H, K, src_RH.stride(0), out_TH.stride(0), HAS_WEIGHTS=weights_TK is not None, ACC=acc, **meta)
    return out_TH


def combine_backward(gout_TH: torch.Tensor, y_RH: torch.Tensor, assign_R: torch.Tensor, *,
                     weights_A: Optional[torch.Tensor], K: int) -> tuple:
    gout_TH, y_RH = _rows_contiguous(gout_TH), _rows_contiguous(y_RH)
    R, H = y_RH.shape
    gy_RH = y_RH.new_empty(R, H)
    gw_A = None if weights_A is None else torch.zeros(weights_A.shape[0], dtype=weights_A.dtype,
                                                      device=weights_A.device)
    if R and H:
        acc = _acc(gout_TH.dtype, y_RH.dtype, *(() if weights_A is None else (weights_A.dtype,)))
        kernel, meta = _launcher("combine_bwd", H)
        assign_R = assign_R.contiguous()
        kernel[(R,)](gout_TH, assign_R, assign_R if weights_A is None else weights_A.contiguous(), y_RH, gy_RH,
                     assign_R if gw_A is None else gw_A, H, K, gout_TH.stride(0), y_RH.stride(0), gy_RH.stride(0),
                     HAS_WEIGHTS=weights_A is not None, ACC=acc, **meta)
    elif R:
        gy_RH.zero_()
    return gy_RH, gw_A


def _rows_contiguous(x_NH: torch.Tensor) -> torch.Tensor:
    # Kernels index columns with stride 1; a row stride of anything is fine.
    return x_NH if x_NH.stride(1) == 1 else x_NH.contiguous()

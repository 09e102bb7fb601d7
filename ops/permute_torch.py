"""Torch reference of the permutation primitives (no autograd; ``permute.py`` wraps them).

Legend: T tokens, K top-k, A = T * K assignments, S sent rows, R rows of an expert-output buffer,
H hidden.

A row index of -1 means "no row": a gather writes zeros there, a combine skips it.
Sums run in k order in the accumulation dtype: float32, or float64 when an input is float64.
"""
from __future__ import annotations

from typing import Optional

import torch


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def gather(src_NH: torch.Tensor, index_M: torch.Tensor) -> torch.Tensor:
    """out_MH[m] = src_NH[index_M[m]] (zeros where index_M[m] == -1)."""
    if src_NH.shape[0] == 0:  # every index is -1
        return src_NH.new_zeros(index_M.shape[0], src_NH.shape[1])
    out_MH = src_NH.index_select(0, index_M.clamp(min=0))
    return _zero_rows(out_MH, index_M < 0)


def combine(src_RH: torch.Tensor, rows_TK: torch.Tensor, weights_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out_TH[t] = sum_k weights_TK[t, k] * src_RH[rows_TK[t, k]] (weight 1 without weights),
    skipping rows_TK == -1; result in src's dtype."""
    T, K = rows_TK.shape
    acc = acc_dtype(src_RH.dtype, *(() if weights_TK is None else (weights_TK.dtype,)))
    parts_TKH = gather(src_RH, rows_TK.reshape(-1)).reshape(T, K, src_RH.shape[1]).to(acc)
    if weights_TK is not None:
        parts_TKH.mul_(weights_TK.to(acc).unsqueeze(2))
    out_TH = parts_TKH[:, 0].clone()
    for k in range(1, K):  # k order, as the kernel sums
        out_TH += parts_TKH[:, k]
    return out_TH.to(src_RH.dtype)


def combine_backward(gout_TH: torch.Tensor, y_RH: torch.Tensor, assign_R: torch.Tensor, *,
                     weights_A: Optional[torch.Tensor], K: int) -> tuple:
    """The gradients of ``combine(y_RH, rows_TK, weights_TK)``, given assign_R (the assignment
    t * K + k whose row is r, or -1):
        gy_RH[r] = weights_A[a] * gout_TH[a // K]        (0 for a row of no assignment)
        gw_A[a]  = <gout_TH[a // K], y_RH[r]>            (0 for an assignment with no row)
    gw_A is None without weights.
    """
    valid_R = assign_R >= 0
    acc = acc_dtype(gout_TH.dtype, y_RH.dtype, *(() if weights_A is None else (weights_A.dtype,)))
    g_RH = gather(gout_TH, torch.where(valid_R, assign_R // K, -1)).to(acc)
    if weights_A is None:
        return g_RH.to(y_RH.dtype), None
    A = weights_A.shape[0]
    w_R = gather(weights_A.unsqueeze(1), assign_R).to(acc)
    dot_R = (g_RH * y_RH.to(acc)).sum(1)
    gy_RH = g_RH.mul_(w_R).to(y_RH.dtype)
    gw_A = torch.zeros(A + 1, dtype=acc, device=y_RH.device)  # slot A takes the rows of no assignment
    gw_A.index_put_((torch.where(valid_R, assign_R, A),), dot_R, accumulate=True)
    return gy_RH, gw_A[:A].to(weights_A.dtype)


def _zero_rows(x_MH: torch.Tensor, mask_M: torch.Tensor) -> torch.Tensor:
    """Zero the rows where mask_M is set. On the CPU through the row indices (a broadcast
    masked_fill is a slow path there; nonzero costs no device sync on the CPU)."""
    if x_MH.device.type != "cpu":
        return x_MH.masked_fill_(mask_M.unsqueeze(1), 0)
    rows = torch.nonzero(mask_M).squeeze(1)
    return x_MH.index_fill_(0, rows, 0) if rows.numel() else x_MH


def invert_rows(rows_TK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """assign_R[r] = the t * K + k with rows_TK[t, k] == r, or -1 (valid rows_TK entries unique).
    No host sync: the -1 entries scatter into a spare slot that is dropped."""
    rows_A = rows_TK.reshape(-1)
    slot_A = torch.where(rows_A >= 0, rows_A, num_rows)
    assign = torch.full((num_rows + 1,), -1, dtype=torch.long, device=rows_TK.device)
    assign.scatter_(0, slot_A, torch.arange(rows_A.numel(), device=rows_TK.device))
    return assign[:num_rows]

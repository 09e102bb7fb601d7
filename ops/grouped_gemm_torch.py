"""Torch reference of the grouped GEMM products (no autograd; ``grouped_gemm`` wraps them).

Legend: R rows, G groups, H in features, F out features.

Equal group sizes (balanced routing) run as one ``torch.bmm`` over [G, R / G, H] views: on the
CPU that is within a few percent of one dense matmul of the same FLOPs, where a Python loop of
small matmuls pays a thread fork/join per group (measured in benchmarks/ops_kernels.py). Other sizes
loop, each ``torch.mm`` written straight into its slice of a preallocated output (``out=``, no
concatenation copy).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ds_fssdp.ops.group_sizes import GroupSizes


def gemm(x_RH: torch.Tensor, w_GHF: torch.Tensor, sizes: Sequence[int], *, trans_w: bool,
         bias_GF: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y_RF[rows of g] = x_RH[rows of g] @ w[g] (``w_GFH[g].T`` if ``trans_w``) + bias_GF[g] if
    given (``baddbmm`` / ``addmm``: the bias is added by the GEMM itself)."""
    sizes = _host(sizes)
    out_features = w_GHF.shape[1] if trans_w else w_GHF.shape[2]
    y_RF = x_RH.new_empty(x_RH.shape[0], out_features)
    if _equal(sizes):
        G, n = len(sizes), sizes[0]
        w = w_GHF.transpose(1, 2) if trans_w else w_GHF
        x_GnH, y_GnF = x_RH.reshape(G, n, -1), y_RF.view(G, n, out_features)
        if bias_GF is None:
            torch.bmm(x_GnH, w, out=y_GnF)
        else:
            torch.baddbmm(bias_GF.unsqueeze(1), x_GnH, w, out=y_GnF)
        return y_RF
    for g, (x_nH, y_nF) in enumerate(zip(x_RH.split(sizes), y_RF.split(sizes))):
        if sizes[g]:
            w = w_GHF[g].t() if trans_w else w_GHF[g]
            if bias_GF is None:
                torch.mm(x_nH, w, out=y_nF)
            else:
                torch.addmm(bias_GF[g], x_nH, w, out=y_nF)
    return y_RF


def wgrad(x_RH: torch.Tensor, dy_RF: torch.Tensor, sizes: Sequence[int], *, trans_w: bool) -> torch.Tensor:
    """dw[g] = x_g.T @ dy_g  ([G, H, F]); with ``trans_w`` dy_g.T @ x_g ([G, F, H]). Empty groups
    get zeros."""
    sizes = _host(sizes)
    H, F = x_RH.shape[1], dy_RF.shape[1]
    dw = x_RH.new_empty((len(sizes), F, H) if trans_w else (len(sizes), H, F))
    if _equal(sizes):
        G, n = len(sizes), sizes[0]
        x_GnH, dy_GnF = x_RH.reshape(G, n, H), dy_RF.reshape(G, n, F)
        if trans_w:
            return torch.bmm(dy_GnF.transpose(1, 2), x_GnH, out=dw)
        return torch.bmm(x_GnH.transpose(1, 2), dy_GnF, out=dw)
    for g, (x_gH, dy_gF) in enumerate(zip(x_RH.split(sizes), dy_RF.split(sizes))):
        if sizes[g] == 0:
            dw[g].zero_()
        elif trans_w:
            torch.mm(dy_gF.t(), x_gH, out=dw[g])
        else:
            torch.mm(x_gH.t(), dy_gF, out=dw[g])
    return dw


def group_sum(dy_RF: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """db[g] = the sum of dy's rows of group g ([G, F]); empty groups get zeros."""
    sizes = _host(sizes)
    G, F = len(sizes), dy_RF.shape[1]
    if _equal(sizes):
        return dy_RF.reshape(G, sizes[0], F).sum(1)
    db_GF = dy_RF.new_zeros(G, F)
    for g, dy_nF in enumerate(dy_RF.split(sizes)):
        if sizes[g]:
            torch.sum(dy_nF, 0, out=db_GF[g])
    return db_GF


def _equal(sizes: Sequence[int]) -> bool:
    return len(sizes) > 1 and sizes[0] > 0 and all(n == sizes[0] for n in sizes)


def _host(sizes) -> Sequence[int]:
    """Host ints of a ``GroupSizes`` (one device->host sync the first time), or the sizes given."""
    return sizes.host() if isinstance(sizes, GroupSizes) else sizes

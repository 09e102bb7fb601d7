"""Grouped GEMM: rows of group g multiply weight g.

Legend: R rows, G groups, H in features, F out features.
"""
from __future__ import annotations

from typing import Sequence

import torch


def grouped_gemm(x_RH: torch.Tensor, w_GHF: torch.Tensor, group_sizes: Sequence[int], *,
                 trans_w: bool = False) -> torch.Tensor:
    """y_RF[rows of group g] = x_RH[rows of group g] @ w_GHF[g] (``w_GFH[g].T`` if ``trans_w``).

    Rows are grouped contiguously in group order; ``group_sizes`` (host ints, summing to R) may
    contain zeros. Example: sizes [2, 0, 1] -> rows 0-1 use w[0], row 2 uses w[2].
    """
    sizes = [int(s) for s in group_sizes]
    if len(sizes) != w_GHF.shape[0]:
        raise ValueError(f"{len(sizes)} group sizes for {w_GHF.shape[0]} weights")
    if sum(sizes) != x_RH.shape[0]:
        raise ValueError(f"group sizes sum to {sum(sizes)}, but x has {x_RH.shape[0]} rows")
    out_features = w_GHF.shape[1] if trans_w else w_GHF.shape[2]
    parts = []
    for g, x_gH in enumerate(torch.split(x_RH, sizes)):
        w = w_GHF[g].t() if trans_w else w_GHF[g]
        parts.append(x_gH @ w)
    if not parts:
        # No groups (so no rows): still return a result tied to x in autograd, so the backward
        # reaches whatever produced x on every rank (a distributed exchange must run everywhere).
        return x_RH @ x_RH.new_zeros(x_RH.shape[1], out_features)
    return torch.cat(parts)

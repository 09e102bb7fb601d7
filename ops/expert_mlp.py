"""The expert MLP over grouped rows, built from the grouped GEMM.

Legend: R rows, G local experts, H hidden, F expert FFN hidden.

gelu (exact erf form):   y = gelu(x @ w_a[g]) @ w_b[g]                     w_a [G,H,F], w_b [G,F,H]
swiglu:                  y = (silu(x @ w_gate[g]) * (x @ w_up[g])) @ w_down[g]
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

from ds_fssdp.ops.group_sizes import GroupSizes, SizesLike
from ds_fssdp.ops.grouped_gemm import grouped_gemm

ACTIVATIONS = {
    "gelu": (("w_a", "in"), ("w_b", "out")),
    "swiglu": (("w_gate", "in"), ("w_up", "in"), ("w_down", "out")),
}


def expert_mlp(x_RH: torch.Tensor, weights: Mapping[str, torch.Tensor], group_sizes: SizesLike, *,
               activation: str) -> torch.Tensor:
    """y_RH for rows grouped by expert (``group_sizes`` as for ``grouped_gemm``). The group sizes
    are converted once (host ints for torch, device offsets for Triton) and shared by every GEMM
    here and in the backward."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation ({activation!r}) must be one of {tuple(ACTIVATIONS)}")
    first = weights[ACTIVATIONS[activation][0][0]]
    group_sizes = GroupSizes.of(group_sizes, num_groups=first.shape[0], num_rows=x_RH.shape[0])
    if activation == "gelu":
        h_RF = F.gelu(grouped_gemm(x_RH, weights["w_a"], group_sizes))
        return grouped_gemm(h_RF, weights["w_b"], group_sizes)
    g_RF = grouped_gemm(x_RH, weights["w_gate"], group_sizes)
    u_RF = grouped_gemm(x_RH, weights["w_up"], group_sizes)
    return grouped_gemm(F.silu(g_RF) * u_RF, weights["w_down"], group_sizes)

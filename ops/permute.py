"""Token permutation: gather rows into dispatch order, and combine expert outputs back.

Legend: T tokens, K top-k, A = T * K assignments, S sent rows, R rows, H hidden.

``permute_rows`` and ``combine_topk`` are the plain torch ops the runtime calls today.
``permute_tokens`` and ``unpermute_combine`` are their kernel-backed successors (Triton on CUDA,
torch elsewhere; ``dispatch.backend_for``), each the other's backward:
  permute_tokens     forward gather x_TH[token_S]; backward sums each token's rows (a combine
                     with unit weights over layout.first_TK), in k order, with no atomics
  unpermute_combine  forward out_TH[t] = sum_k w[t, k] * y_RH[rows_TK[t, k]]; backward scatters
                     w * gout back to the rows (a gather) and takes gw[t, k] = <gout[t], y[row]>
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ds_fssdp.ops import permute_torch
from ds_fssdp.ops.dispatch import backend_for
from ds_fssdp.ops.permute_layout import PermuteLayout


def permute_rows(x_TH: torch.Tensor, index_R: torch.Tensor) -> torch.Tensor:
    """rows_RH[r] = x_TH[index_R[r]] (a token may appear several times). Autograd: the backward
    sums the row gradients back into their tokens."""
    return x_TH.index_select(0, index_R)


def combine_topk(y_AH: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """out_TH[t] = sum_k weights_TK[t, k] * y_AH[t * K + k], summed in k order (deterministic).

    ``y_AH`` is in assignment order. The product is taken in the weights' dtype (fp32 from the
    gate) and the result returned in ``y_AH``'s dtype.
    """
    T, K = weights_TK.shape
    y_TKH = y_AH.reshape(T, K, y_AH.shape[-1])
    out_TH = (y_TKH.to(weights_TK.dtype) * weights_TK.unsqueeze(-1)).sum(1)
    return out_TH.to(y_AH.dtype)


def permute_tokens(x_TH: torch.Tensor, layout: PermuteLayout) -> torch.Tensor:
    """rows_SH[s] = x_TH[layout.token_S[s]]: one contiguous send buffer in the layout's order.

    Example: x [[1], [2]], token_S [1, 0, 1], first_TK [[1, -1], [0, 2]] -> rows [[2], [1], [2]];
    the backward gives gx[0] = g[1], gx[1] = g[0] + g[2].
    """
    if x_TH.shape[0] != layout.first_TK.shape[0]:
        raise ValueError(f"x has {x_TH.shape[0]} tokens, the layout {layout.first_TK.shape[0]}")
    dev = x_TH.device
    return _PermuteTokens.apply(x_TH, layout.token_S.to(dev), layout.first_TK.to(dev), _kernels(x_TH))


def unpermute_combine(y_RH: torch.Tensor, rows_TK: torch.Tensor,
                      weights_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out_TH[t] = sum_k weights_TK[t, k] * y_RH[rows_TK[t, k]] (weight 1 without weights),
    skipping rows -1, summed in k order in fp32 (fp64 if an input is), returned in y's dtype.

    The valid entries of ``rows_TK`` must be distinct (each row belongs to one assignment): use
    ``layout.row_TK`` for a buffer of one row per assignment (no dedup), ``layout.first_TK`` for
    one row per (token, destination). Example: y [[1], [2], [4]], rows [[2, 0], [1, -1]],
    weights [[0.5, 1], [3, 9]] -> [[3], [6]].
    """
    if weights_TK is not None and weights_TK.shape != rows_TK.shape:
        raise ValueError(f"weights_TK {tuple(weights_TK.shape)} and rows_TK {tuple(rows_TK.shape)} differ")
    rows_TK = rows_TK.to(y_RH.device)
    return _UnpermuteCombine.apply(y_RH, rows_TK, weights_TK, _kernels(y_RH))


class _PermuteTokens(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_TH, token_S, first_TK, kernels):
        ctx.save_for_backward(first_TK)
        ctx.kernels = kernels
        return kernels.gather(x_TH, token_S)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_SH):
        (first_TK,) = ctx.saved_tensors
        return ctx.kernels.combine(g_SH, first_TK, None), None, None, None


class _UnpermuteCombine(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y_RH, rows_TK, weights_TK, kernels):
        ctx.save_for_backward(y_RH, rows_TK, weights_TK)
        ctx.kernels = kernels
        return kernels.combine(y_RH, rows_TK, weights_TK)

    @staticmethod
    @once_differentiable
    def backward(ctx, gout_TH):
        y_RH, rows_TK, weights_TK = ctx.saved_tensors
        assign_R = permute_torch.invert_rows(rows_TK, y_RH.shape[0])
        weights_A = None if weights_TK is None else weights_TK.reshape(-1)
        gy_RH, gw_A = ctx.kernels.combine_backward(gout_TH, y_RH, assign_R, weights_A=weights_A, K=rows_TK.shape[1])
        gw_TK = None if gw_A is None or not ctx.needs_input_grad[2] else gw_A.reshape(rows_TK.shape)
        return gy_RH, None, gw_TK, None


def _kernels(x: torch.Tensor):
    if backend_for(x.device) == "triton":
        return importlib.import_module("ds_fssdp.ops.triton.permute_kernels")
    return permute_torch

"""Token permutation: the send buffer of a token exchange, and the fused unpermute + top-k combine
of its return. ``ds_fssdp.moe.compute`` calls both on every MoE layer's forward.

Legend: T tokens, K top-k, A = T * K assignments, S sent rows, R rows, H hidden.

Each runs the Triton kernels on CUDA tensors and the torch reference (``permute_torch``)
elsewhere (``dispatch.backend_for``), and each one's backward is the other's kind of kernel:
  permute_tokens     forward  rows_SH[s] = x_TH[token_S[s]] (a gather)
                     backward gx[t] = sum_k g[rows_TK[t, k]] (a combine with unit weights)
  unpermute_combine  forward  out_TH[t] = sum_k w[t, k] * y_RH[rows_TK[t, k]] (a combine)
                     backward gy[rows_TK[t, k]] = w[t, k] * gout[t] (a gather) and
                              gw[t, k] = <gout[t], y[rows_TK[t, k]]>
Sums run in k order in fp32 (fp64 for fp64 inputs), one program or row per output, no atomics:
the results do not depend on the device's scheduling.
"""
from __future__ import annotations

import importlib
from typing import Callable, Optional, Union

import torch
from torch.autograd.function import once_differentiable

from ds_fssdp.ops import permute_torch
from ds_fssdp.ops.dispatch import backend_for

RowsLike = Union[torch.Tensor, Callable[[], torch.Tensor]]


def permute_tokens(x_TH: torch.Tensor, token_S: torch.Tensor, rows_TK: RowsLike) -> torch.Tensor:
    """rows_SH[s] = x_TH[token_S[s]]: one contiguous send buffer in ``token_S``'s order.

    ``rows_TK`` [T, K] is where each token's rows went: every sent row s appears in it exactly
    once, in its token's line (``token_S[rows_TK[t, k]] == t``), -1 fills the rest. The backward
    sums each token's row gradients in k order. It may be given as a callable, called in the
    backward only (the runtime's route computes it after the exchange is launched).

    Example: x [[1], [2]], token_S [1, 0, 1], rows_TK [[1, -1], [0, 2]] -> rows [[2], [1], [2]];
    the backward gives gx[0] = g[1], gx[1] = g[0] + g[2].
    """
    if isinstance(rows_TK, torch.Tensor) and rows_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"x has {x_TH.shape[0]} tokens, rows_TK {rows_TK.shape[0]}")
    return _PermuteTokens.apply(x_TH, token_S.to(x_TH.device), rows_TK, _kernels(x_TH))


def unpermute_combine(y_RH: torch.Tensor, rows_TK: torch.Tensor,
                      weights_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out_TH[t] = sum_k weights_TK[t, k] * y_RH[rows_TK[t, k]] (weight 1 without weights),
    skipping rows -1, summed in k order in fp32 (fp64 if an input is), returned in y's dtype.

    The valid entries of ``rows_TK`` must be distinct (each row belongs to one assignment): the
    runtime passes the inverse of its send order, one row per assignment. Example: y [[1], [2],
    [4]], rows [[2, 0], [1, -1]], weights [[0.5, 1], [3, 9]] -> [[3], [6]].
    """
    if weights_TK is not None and weights_TK.shape != rows_TK.shape:
        raise ValueError(f"weights_TK {tuple(weights_TK.shape)} and rows_TK {tuple(rows_TK.shape)} differ")
    rows_TK = rows_TK.to(y_RH.device)
    return _UnpermuteCombine.apply(y_RH, rows_TK, weights_TK, _kernels(y_RH))


class _PermuteTokens(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_TH, token_S, rows_TK, kernels):
        ctx.rows_TK, ctx.kernels, ctx.device = rows_TK, kernels, x_TH.device
        return kernels.gather(x_TH, token_S)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_SH):
        rows_TK = ctx.rows_TK() if callable(ctx.rows_TK) else ctx.rows_TK
        return ctx.kernels.combine(g_SH, rows_TK.to(ctx.device), None), None, None, None


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
    triton = backend_for(x.device) == "triton"
    return importlib.import_module("ds_fssdp.ops.triton.permute_kernels") if triton else permute_torch

"""Grouped GEMM: rows of group g multiply weight g; forward and both backward products.

Legend: R rows, G groups, H in features, F out features.

One autograd Function serves both implementations (``dispatch.backend_for``): the torch
reference (``grouped_gemm_torch``, over host sizes) and the Triton kernels
(``triton/grouped_gemm_kernels``, over sizes and offsets on the device), both given a ``GroupSizes``.
  forward  y_RF = x_g @ w[g] (+ bias[g])
  dx_RH    = dy_g @ w[g].T      (the same grouped product with the weight transposed)
  dw[g]    = x_g.T @ dy_g       (a reduction over each group's rows; zeros for an empty group)
  dbias[g] = sum of dy_g's rows (zeros for an empty group)
"""
from __future__ import annotations

import importlib
import logging
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ds_fssdp.ops import grouped_gemm_torch
from ds_fssdp.ops.dispatch import backend_for
from ds_fssdp.ops.group_sizes import GroupSizes, SizesLike

logger = logging.getLogger(__name__)

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_logged_dtypes: set = set()


def grouped_gemm(x_RH: torch.Tensor, w_GHF: torch.Tensor, group_sizes: SizesLike, *,
                 bias: Optional[torch.Tensor] = None, trans_w: bool = False) -> torch.Tensor:
    """y_RF[rows of group g] = x_RH[rows of group g] @ w_GHF[g] (``w_GFH[g].T`` if ``trans_w``),
    plus ``bias`` [G, F] row g if given (added in the GEMM's epilogue, before rounding).

    Rows are grouped contiguously in group order; ``group_sizes`` (host ints, a 1-D integer
    tensor, or a ``GroupSizes``) may contain zeros. Example: sizes [2, 0, 1] -> rows 0-1 use
    w[0], row 2 uses w[2]. The result is always tied to x and w in autograd, also with no rows
    or no groups, so the backward reaches whatever produced x on every rank (a distributed
    exchange must run its backward everywhere).
    """
    if x_RH.dim() != 2 or w_GHF.dim() != 3:
        raise ValueError(f"grouped_gemm wants x [R, H] and w [G, H, F], got {tuple(x_RH.shape)} and "
                         f"{tuple(w_GHF.shape)}")
    in_features = w_GHF.shape[2] if trans_w else w_GHF.shape[1]
    if x_RH.shape[1] != in_features:
        raise ValueError(f"x has {x_RH.shape[1]} features, w (trans_w={trans_w}) expects {in_features}")
    if x_RH.dtype != w_GHF.dtype or x_RH.device != w_GHF.device:
        raise ValueError(f"x ({x_RH.dtype}, {x_RH.device}) and w ({w_GHF.dtype}, {w_GHF.device}) differ")
    if bias is not None:
        out_features = w_GHF.shape[1] if trans_w else w_GHF.shape[2]
        if tuple(bias.shape) != (w_GHF.shape[0], out_features):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected [G, F] = "
                             f"{[w_GHF.shape[0], out_features]} for w {tuple(w_GHF.shape)} (trans_w={trans_w})")
        if bias.dtype != w_GHF.dtype or bias.device != w_GHF.device:
            raise ValueError(f"bias ({bias.dtype}, {bias.device}) and w ({w_GHF.dtype}, {w_GHF.device}) differ")
    sizes = GroupSizes.of(group_sizes, num_groups=w_GHF.shape[0], num_rows=x_RH.shape[0])
    return _GroupedGemm.apply(x_RH, w_GHF, bias, sizes, trans_w, implementation(x_RH))


class _GroupedGemm(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_RH, w_GHF, bias_GF, sizes, trans_w, impl):
        ctx.save_for_backward(x_RH, w_GHF)
        ctx.sizes, ctx.trans_w, ctx.impl = sizes, trans_w, impl
        return impl.gemm(x_RH, w_GHF, sizes, trans_w=trans_w, bias_GF=bias_GF)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_RF):
        x_RH, w_GHF = ctx.saved_tensors
        dx_RH = dw = dbias = None
        if ctx.needs_input_grad[0]:
            dx_RH = ctx.impl.gemm(dy_RF, w_GHF, ctx.sizes, trans_w=not ctx.trans_w)
        if ctx.needs_input_grad[1]:
            dw = ctx.impl.wgrad(x_RH, dy_RF, ctx.sizes, trans_w=ctx.trans_w)
        if ctx.needs_input_grad[2]:
            dbias = ctx.impl.group_sum(dy_RF, ctx.sizes)
        return dx_RH, dw, dbias, None, None, None


def implementation(x: torch.Tensor):
    """The torch reference or the Triton kernels (``triton/grouped_gemm_kernels``) for x's device and
    dtype (dtypes without a kernel: torch, logged)."""
    if backend_for(x.device) != "triton":
        return grouped_gemm_torch
    if x.dtype in TRITON_DTYPES:
        return importlib.import_module("ds_fssdp.ops.triton.grouped_gemm_kernels")
    if x.dtype not in _logged_dtypes:
        _logged_dtypes.add(x.dtype)
        logger.info("ds_fssdp.ops.grouped_gemm: no Triton kernel for %s; the torch reference runs it", x.dtype)
    return grouped_gemm_torch

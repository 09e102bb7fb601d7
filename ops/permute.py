"""Token permutation: gather rows into dispatch order, and combine expert outputs back.

Legend: T tokens, K top-k, A = T * K assignments, R rows, H hidden.
"""
from __future__ import annotations

import torch


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

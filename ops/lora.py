"""LoRA on grouped expert rows: each group's rows get their own expert's low-rank update.

Legend: R rows, G local experts, I in features, O out features, r LoRA rank.

  delta_RO[rows of group g] = scaling * (x_g @ a_GIr[g]) @ b_GrO[g]

``a_GIr[g]`` is expert g's ``A^T`` and ``b_GrO[g]`` its ``B^T``, so a projection ``x @ W[g]``
becomes ``x @ (W[g] + scaling * A_g^T B_g^T)`` without forming the [I, O] product: PEFT's
``ParamWrapper`` math for fused expert tensors (``peft/tuners/lora/layer.py``), computed on the
rows an expert actually has. Both products are grouped GEMMs, so the gradients reach x, a and b
(the factors are ordinary autograd leaves or views of them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_fssdp.ops.group_sizes import SizesLike
from ds_fssdp.ops.grouped_gemm import grouped_gemm


@dataclass(frozen=True)
class LoraFactors:
    """One adapter's factors of one expert projection, stacked over the local experts."""
    a_GIr: torch.Tensor
    b_GrO: torch.Tensor
    scaling: float


def lora_delta(x_RI: torch.Tensor, factors: LoraFactors, group_sizes: SizesLike) -> torch.Tensor:
    """``scaling * (x_g @ a[g]) @ b[g]`` for the rows of every group g."""
    a_GIr = factors.a_GIr.to(x_RI.dtype)
    b_GrO = factors.b_GrO.to(x_RI.dtype)
    return grouped_gemm(grouped_gemm(x_RI, a_GIr, group_sizes), b_GrO, group_sizes) * factors.scaling

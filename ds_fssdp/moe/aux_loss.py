"""An MoE layer's auxiliary loss added to the training loss in the backward, where the layer is.

Legend: T tokens, H hidden.

Under pipeline parallelism the loss is computed on the last stage, but a router's load-balancing
loss is made on whichever stage holds its layer. Carrying it to the last stage in the activations
needs every stage to pass an extra tensor with a gradient (DeepSpeed's shared receive buffers
break when it is not at tuple position 1, deepspeed #7055). Megatron-Core's
``MoEAuxLossAutoScaler`` does it without crossing stages, and so does :class:`AuxLossToBackward`:
``x = aux_to_backward(x, l_aux)`` returns ``x`` unchanged, and its backward gives ``l_aux`` the
gradient ``coef * scale``, the one a ``coef * l_aux`` term of the micro-batch's loss would get.
``scale`` is what the engine's backward multiplies a micro-batch's loss by (1 / gradient
accumulation steps, times the loss scale), set by ``runtime/pipeline.py`` before each backward.

Each forward that is not a recompute (activation checkpointing replays it inside the backward)
adds ``coef * l_aux`` to :attr:`AuxLossToBackward.total`, so the engine can report the loss the
model would have returned (cross-entropy plus the auxiliary terms) without another exchange per
micro-batch.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class AuxLossToBackward(nn.Module):
    """``forward(x, aux) -> x``; the backward adds ``coef * scale`` to ``aux``'s gradient."""

    def __init__(self, coef: float = 1.0):
        super().__init__()
        self.coef = float(coef)
        self.scale = None  # set by the engine before each backward (runtime/pipeline.py)
        self.total = None  # sum of coef * aux over the forwards since reset_total (detached, fp32)

    def reset_total(self) -> None:
        self.total = None

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside the backward: counted once
            term = self.coef * aux.detach().float()
            self.total = term if self.total is None else self.total + term
        return _ToBackward.apply(x, aux, self) if torch.is_grad_enabled() and aux.requires_grad else x


class _ToBackward(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_TH, aux, owner):
        ctx.owner = owner
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x_TH

    @staticmethod
    def backward(ctx, dx_TH):
        owner = ctx.owner
        if owner.scale is None:
            raise RuntimeError("AuxLossToBackward: no loss scale was set (the module is meant for ds_fssdp's pipeline "
                               "engine, which sets it before each backward; without pipeline parallelism add the "
                               "auxiliary loss to the loss instead)")
        grad = torch.full(ctx.aux_shape, owner.coef * owner.scale, dtype=ctx.aux_dtype, device=dx_TH.device)
        return dx_TH, grad, None

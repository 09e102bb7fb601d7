"""Tensor-parallel folding of an MoE layer (AutoEP's "route full, partition the dispatch";
docs/design.md section 5, AutoTP).

Legend: T tokens (identical on every TP rank), C = ceil(T / p) tokens per TP rank's slice, p TP ranks.

Each TP rank dispatches only its slice (rows ``[r * C, min(T, (r + 1) * C))``) of the tokens every TP
rank holds, and the slices' outputs are all-gathered. The pair is Megatron's sequence-parallel one,
so the gradients stay a replicated layer's: ``split``'s backward all-gathers the slices' gradients
(the router and everything before get the full gradient on every TP rank), ``gather``'s takes this
rank's slice of the incoming gradient (identical on every TP rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from deepspeed import comm as dist


@dataclass(frozen=True)
class TPFold:
    group: object  # the TP group (every rank of it holds the same tokens)
    size: int  # p
    rank: int  # this rank in the TP group

    def bounds(self, num_tokens: int) -> tuple:
        chunk = -(-num_tokens // self.size)
        return min(num_tokens, self.rank * chunk), min(num_tokens, (self.rank + 1) * chunk), chunk


class _Split(torch.autograd.Function):
    """This TP rank's slice; the backward all-gathers the slices' gradients (:class:`_Gather`)."""

    @staticmethod
    def forward(ctx, x_TH, fold):
        ctx.fold, ctx.num_tokens = fold, x_TH.shape[0]
        start, end, _ = fold.bounds(x_TH.shape[0])
        return x_TH[start:end]

    @staticmethod
    def backward(ctx, grad_CH):
        return _Gather.apply(grad_CH.contiguous(), ctx.fold, ctx.num_tokens), None


class _Gather(torch.autograd.Function):
    """Every TP rank's slice (each padded to C rows) -> [T, ...]; the backward takes this rank's slice."""

    @staticmethod
    def forward(ctx, x_CH, fold, num_tokens):
        ctx.fold = fold
        start, end, chunk = fold.bounds(num_tokens)
        padded = x_CH.new_zeros((chunk, ) + tuple(x_CH.shape[1:]))
        padded[:end - start] = x_CH
        out = x_CH.new_empty((chunk * fold.size, ) + tuple(x_CH.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=fold.group)
        return out[:num_tokens]

    @staticmethod
    def backward(ctx, grad_TH):
        return _Split.apply(grad_TH, ctx.fold).contiguous(), None, None


def split(x_TH: torch.Tensor, fold: TPFold) -> torch.Tensor:
    """This TP rank's slice of ``x_TH`` (integer tensors: no gradient)."""
    return _Split.apply(x_TH, fold)


def gather(x_CH: torch.Tensor, fold: TPFold, num_tokens: int) -> torch.Tensor:
    """The TP ranks' slices, in order, as [T, ...] on every TP rank."""
    return _Gather.apply(x_CH, fold, num_tokens)

"""Token exchange over deepspeed.comm: the uneven all-to-all with autograd, and the count gather.

Legend: E experts, D ranks, R rows, H hidden.
"""
from __future__ import annotations

import torch
from deepspeed import comm as dist


class _AllToAll(torch.autograd.Function):
    """Forward sends ``in_splits[d]`` rows to rank d and receives ``out_splits[d]`` from it; the
    backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, x_RH, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x_RH.new_empty((sum(out_splits), ) + tuple(x_RH.shape[1:]))
        dist.all_to_all_single(out, x_RH.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad_out, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x_RH: torch.Tensor, out_splits: list, in_splits: list, *, group) -> torch.Tensor:
    return _AllToAll.apply(x_RH, list(out_splits), list(in_splits), group)


def all_gather_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    """Every rank's per-expert assignment counts -> tokens_ED (long [E, D], on the host)."""
    world = dist.get_world_size(group=group)
    out_D = [torch.empty_like(counts_E) for _ in range(world)]
    dist.all_gather(out_D, counts_E.contiguous(), group=group)
    return torch.stack(out_D, 1).cpu()

"""Expert compute that does not keep the replica weights alive between forward and backward.

Legend: R rows, H hidden, S owned rows, Q replica rows, P elements per expert.

Re-materialization (paper section 3.1): a layer's replicas are freed right after its forward and
gathered again during the backward of the following block's attention. Autograd would keep the
weights alive (a matmul saves its weight for the input gradient), so this Function saves only the
grouped input and the owned rows; its backward fetches the re-gathered replicas from the
``source``, recomputes the expert MLP (activation recomputation) and returns the input and
owned-row gradients. The replicas' gradient goes to ``source.replica_grad_ready`` (which starts
the SparseReduceScatter), since the replica rows are not an autograd input.
"""
from __future__ import annotations

import torch

from ds_fssdp import ops


class RematExpertMLP(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_RH, rows_SP, replica_QP, source, spec, group_sizes):
        with torch.no_grad():
            weights = spec.views(torch.cat([rows_SP, replica_QP]))
            y_RH = ops.expert_mlp(x_RH, weights, group_sizes, activation=spec.activation,
                                  act_params=spec.act_params)
        ctx.save_for_backward(x_RH, rows_SP)
        ctx.source, ctx.spec, ctx.group_sizes = source, spec, group_sizes
        return y_RH

    @staticmethod
    def backward(ctx, dy_RH):
        x_RH, rows_SP = ctx.saved_tensors
        replica_QP = ctx.source.rematerialized()
        with torch.enable_grad():
            x = x_RH.detach().requires_grad_(True)
            rows = rows_SP.detach().requires_grad_(True)
            replica = replica_QP.detach().requires_grad_(True)
            weights = ctx.spec.views(torch.cat([rows, replica]))
            y = ops.expert_mlp(x, weights, ctx.group_sizes, activation=ctx.spec.activation,
                               act_params=ctx.spec.act_params)
            dx, drows, dreplica = torch.autograd.grad(y, [x, rows, replica], dy_RH, allow_unused=True)
        ctx.source.replica_grad_ready(dreplica if dreplica is not None else torch.zeros_like(replica))
        if drows is None:
            drows = torch.zeros_like(rows_SP)
        return dx, drows, None, None, None, None

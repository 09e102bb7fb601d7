"""SparseAllGather and SparseReduceScatter over deepspeed.comm (paper section 3.2).

Legend: S rows owned here, R replica rows received here, P elements per expert row.

Both run as one all-to-all with splits laid out by ``planner.gather_layout``: only the placement
delta moves, one row per added (expert, rank) pair, so each collective moves exactly
|P' \\ P| * Psi bytes over the group (Eq. 4). Handles are asynchronous; ``wait()`` returns the
result.
"""
from __future__ import annotations

import torch
from deepspeed import comm as dist

from ds_fssdp.planner.transfers import GatherLayout


class _Pending:
    """An asynchronous collective and the buffer it fills."""

    def __init__(self, work, result):
        self._work, self._result = work, result

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result


def sparse_all_gather(rows_SP: torch.Tensor, layout: GatherLayout, group, *, async_op: bool = True):
    """Deliver this rank's replica rows (ordered like ``layout.replica_E``). Returns (handle,
    bytes sent by this rank)."""
    send = rows_SP.detach().index_select(0, layout.send_rows.to(rows_SP.device))
    recv = rows_SP.new_empty(sum(layout.recv_splits), rows_SP.shape[1])
    work = dist.all_to_all_single(recv, send, output_split_sizes=layout.recv_splits,
                                  input_split_sizes=layout.send_splits, group=group, async_op=async_op)
    handle = _Pending(work if async_op else None, recv)
    return handle, send.numel() * send.element_size()


def sparse_reduce_scatter(replica_grad_RP: torch.Tensor, layout: GatherLayout, group, *, async_op: bool = True):
    """Send each replica's gradient to its owner. The handle's ``wait()`` returns (rows, grads):
    owned row indices and the gradients to add into them (sum with ``index_add_``). Returns
    (handle, bytes sent by this rank)."""
    recv = replica_grad_RP.new_empty(sum(layout.send_splits), replica_grad_RP.shape[1])
    work = dist.all_to_all_single(recv, replica_grad_RP.contiguous(), output_split_sizes=layout.send_splits,
                                  input_split_sizes=layout.recv_splits, group=group, async_op=async_op)
    rows = layout.send_rows.to(recv.device)
    handle = _Pending(work if async_op else None, (rows, recv))
    return handle, replica_grad_RP.numel() * replica_grad_RP.element_size()


@torch.no_grad()
def scatter_rows(full_EP: torch.Tensor, owner_E: torch.Tensor, *, src: int, group) -> torch.Tensor:
    """Rank ``src``'s full [E, P] rows -> each rank's owned rows [S, P] (experts ascending).

    Moves each expert once, from ``src`` to its owner (one all-to-all)."""
    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    owner_E = owner_E.to("cpu", torch.long)
    owned_counts = torch.bincount(owner_E, minlength=world).tolist()
    if rank == src:
        order = torch.sort(owner_E, stable=True).indices.to(full_EP.device)
        send, send_splits = full_EP.index_select(0, order).contiguous(), owned_counts
    else:
        send, send_splits = full_EP.new_empty(0, full_EP.shape[1]), [0] * world
    recv_splits = [owned_counts[rank] if s == src else 0 for s in range(world)]
    recv = full_EP.new_empty(owned_counts[rank], full_EP.shape[1])
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return recv

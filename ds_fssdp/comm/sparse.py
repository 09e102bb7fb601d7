"""SparseAllGather and SparseReduceScatter over deepspeed.comm (paper section 3.2).

Legend: S rows owned here, R replica rows held here, P elements per expert row.

Each phase of a ``planner.GatherLayout`` is one all-to-all with splits: only the placement delta
moves, one row per transfer. ``start()`` issues the first phase asynchronously; ``finish()``
(called where the result is needed) waits for it and runs the second, intra-node phase if the
layout is hierarchical. Both are called from the main thread in program order, so every rank
issues the collectives of a process group in the same order.
"""
from __future__ import annotations

import torch
from deepspeed import comm as dist

from ds_fssdp.planner.transfers import GatherLayout


class _Phases:
    """The phases' all-to-alls, one in flight at a time (``_work``, landing in ``_recv``)."""

    def __init__(self, layout: GatherLayout, group):
        self.layout, self.group = layout, group
        self._work = self._recv = None
        self.sent = 0  # bytes this rank sent for this collective

    def _issue(self, source, send_rows, send_splits, recv_splits, *, async_op) -> None:
        send = source.index_select(0, send_rows.to(source.device))
        self._recv = source.new_empty(sum(recv_splits), source.shape[1])
        self.sent += send.numel() * send.element_size()
        self._work = dist.all_to_all_single(self._recv, send, output_split_sizes=recv_splits,
                                            input_split_sizes=send_splits, group=self.group, async_op=async_op)

    def _wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


class SparseAllGather(_Phases):
    """Materialize this rank's replica rows (ordered like ``layout.replica_E``)."""

    def __init__(self, rows_SP: torch.Tensor, layout: GatherLayout, group):
        super().__init__(layout, group)
        self.replica_RP = rows_SP.new_empty(layout.replica_E.numel(), rows_SP.shape[1])
        self._rows_SP = rows_SP.detach()

    def start(self) -> "SparseAllGather":
        if self.layout.phases:
            phase = self.layout.phases[0]
            self._issue(self._rows_SP, phase.send_rows, phase.send_splits, phase.recv_splits, async_op=True)
        return self

    @property
    def in_flight(self) -> bool:
        """The first phase was started and has not landed yet (a non-blocking query)."""
        return self._work is not None and not self._work.is_completed()

    def finish(self) -> torch.Tensor:
        for i, phase in enumerate(self.layout.phases):
            if i:
                self._issue(self.replica_RP, phase.send_rows, phase.send_splits, phase.recv_splits, async_op=False)
            self._wait()
            self.replica_RP.index_copy_(0, phase.recv_rows.to(self.replica_RP.device), self._recv)
        return self.replica_RP


class SparseReduceScatter(_Phases):
    """Return every replica's gradient to the owner of its expert, summed per node on the way.

    ``finish()`` returns (owned row indices, gradients) to be summed into the owned rows'
    gradient with ``index_add_`` (in the caller's precision)."""

    def __init__(self, replica_grad_RP: torch.Tensor, layout: GatherLayout, group):
        super().__init__(layout, group)
        self.grad_RP = replica_grad_RP.detach().clone() if len(layout.phases) > 1 else replica_grad_RP.detach()

    def start(self) -> "SparseReduceScatter":
        if self.layout.phases:
            self._issue_reversed(self.layout.phases[-1], async_op=True)
        return self

    def finish(self) -> tuple:
        phases = self.layout.phases
        if not phases:
            return torch.zeros(0, dtype=torch.long), self.grad_RP[:0]
        self._wait()
        if len(phases) > 1:
            # Relays add the node's partial sums into their own replica gradient, then send on.
            self.grad_RP.index_add_(0, phases[-1].send_rows.to(self.grad_RP.device), self._recv)
            self._issue_reversed(phases[0], async_op=False)
        return phases[0].send_rows.to(self._recv.device), self._recv

    def _issue_reversed(self, phase, *, async_op) -> None:
        # Reversed: what was received is sent back, what was sent comes back.
        self._issue(self.grad_RP, phase.recv_rows, phase.recv_splits, phase.send_splits, async_op=async_op)


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

"""The token dispatcher of one sharded layer: route the gate's assignments by the dispatch plan and
run ``compute.dispatch_compute_combine`` over the uneven all-to-all (Megatron-Core's token
dispatcher: local index math, the exchange, the expert compute, the exchange back, the combine).

Legend: T tokens, K top-k, H hidden, E experts.

With ``dedup`` (``fssdp.one_copy_per_destination``, ``moe/dedup.py``) a token crosses to a rank
once: :meth:`route` adds two small exchanges after the plan, one all-gather of every rank's
unique rows per destination (D ints each: the receive counts, which the plan does not hold, and
the group's bytes saved) and one all-to-all of the routing entries (K longs per unique row); the
gate weights travel in :meth:`run` (one more all-to-all, and its backward).

The route is split around the plan: :meth:`group` (the assignments grouped by expert) needs no
plan and runs before the count all-gather; :meth:`route` cuts it by the plan afterwards.
"""
from __future__ import annotations

import torch

from ds_fssdp.comm import all_gather_counts, all_to_all
from ds_fssdp.moe.compute import dispatch_compute_combine, dispatch_compute_combine_dedup
from ds_fssdp.moe.dedup import DedupRoute, receive_tables, send_tables
from ds_fssdp.moe.routing import expert_order, route


class TokenDispatcher:

    def __init__(self, *, group, rank: int, num_experts: int, dedup: bool = False):
        self.group = group
        self.rank = rank
        self.num_experts = num_experts
        self.dedup = dedup

    def group_by_expert(self, idx_TK: torch.Tensor):
        """The route's plan-free half (before the count all-gather and the replicas' wait)."""
        return expert_order(idx_TK, self.num_experts)

    def all_gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """tokens_ED: every rank's counts per expert (the one synchronisation the plan needs)."""
        return all_gather_counts(counts_E, self.group)

    def route(self, idx_TK: torch.Tensor, plan, *, local_E: torch.Tensor, grouped=None):
        """A :class:`~ds_fssdp.moe.routing.Route`, or with ``dedup`` a :class:`DedupRoute`
        (collective: every rank of the group calls it)."""
        r = route(idx_TK, plan, rank=self.rank, local_E=local_E, grouped=grouped)
        if not self.dedup:
            return r
        T, K = idx_TK.shape
        s = send_tables(r, T, K)
        uniq_DD = all_gather_counts(torch.tensor(s.splits, dtype=torch.long, device=idx_TK.device), self.group).t()
        recv_splits = uniq_DD[:, self.rank].tolist()
        meta_UK = all_to_all(s.meta_UK, recv_splits, s.splits, group=self.group)
        rows_UK, token_C = receive_tables(r, meta_UK, recv_splits, check=not meta_UK.is_cuda)
        return DedupRoute(route=r, send=s, recv_splits=recv_splits, rows_UK=rows_UK, token_C=token_C, uniq_DD=uniq_DD)

    def run(self, x_TH: torch.Tensor, weights_TK: torch.Tensor, r, *, expert_fn) -> torch.Tensor:
        """Send, compute, return, combine: out_TH."""
        if isinstance(r, DedupRoute):
            return dispatch_compute_combine_dedup(x_TH, weights_TK, r, expert_fn=expert_fn, exchange=self._exchange)
        return dispatch_compute_combine(x_TH, weights_TK, r, expert_fn=expert_fn, exchange=self._exchange)

    def _exchange(self, x, out_splits, in_splits):
        return all_to_all(x, out_splits, in_splits, group=self.group)

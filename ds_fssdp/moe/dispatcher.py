"""The token dispatcher of one sharded layer: route the gate's assignments by the dispatch plan and
run ``compute.dispatch_compute_combine`` over the uneven all-to-all (Megatron-Core's token
dispatcher: local index math, the exchange, the expert compute, the exchange back, the combine).

Legend: T tokens, K top-k, H hidden, E experts.

With ``dedup`` (``fssdp.one_copy_per_destination``, ``moe/dedup.py``) a token crosses to a rank
once: :meth:`route` adds two small exchanges per hop after the plan, one all-gather of every
rank's unique rows per destination (D ints each: the receive counts, which the plan does not
hold, and the group's bytes saved) and one all-to-all of the routing entries (K longs per unique
row, 2K to a relay); the gate weights travel in :meth:`run`, as K more columns of the rows
when they share the rows' dtype (``compute.exchange_with_weights``; else one more all-to-all per
hop, and its backward; chunked, the weights cross unchunked first). With several nodes of several
ranks (``ranks_per_node``) there are two hops: to the relay in the destination's node, then inside
that node; chunked, both hops pipeline (``moe/relay.py``: :meth:`route` stages the last hop by
the relay rows' atoms, and its count all-gather carries D x (A + 1) ints).

The route is split around the plan: :meth:`group` (the assignments grouped by expert) needs no
plan and runs before the count all-gather; :meth:`route` cuts it by the plan afterwards.
"""
from __future__ import annotations

import torch

from ds_fssdp.comm import all_gather_counts, all_to_all
from ds_fssdp.moe.compute import dispatch_compute_combine, dispatch_compute_combine_dedup
from ds_fssdp.moe.dedup import DedupRoute, hop_entries, hop_tables, receive_tables, relay_of, slot_targets
from ds_fssdp.moe.pipeline import (atom_cuts, atom_of_rows, pipelined_dispatch_compute_combine,
                                   pipelined_dispatch_compute_combine_dedup)
from ds_fssdp.moe.relay import relay_dispatch_compute_combine
from ds_fssdp.moe.routing import expert_order, route
from ds_fssdp.planner.plan import DispatchPlan


class TokenDispatcher:

    def __init__(self, *, group, rank: int, num_experts: int, exchange=None, world: int | None = None,
                 dedup: bool = False, ranks_per_node: int | None = None, timings=None):
        """``exchange``: the chunked exchange's :class:`~ds_fssdp.moe.pipeline.ExchangeGroups`
        (``run_pipelined``); ``world``: the group's ranks. ``ranks_per_node``: with ``dedup`` and
        several nodes of several ranks, rows cross to a node once, to a relay there, which forwards
        them inside its node (None: one hop). ``timings``: a ``moe.timing.LayerTimings`` timing each
        exchange (None: untimed)."""
        self.group = group
        self.exchange = exchange
        self.world = world
        self.rank = rank
        self.num_experts = num_experts
        self.timings = timings
        self.dedup = dedup
        self.ranks_per_node = ranks_per_node or 1

    def group_by_expert(self, idx_TK: torch.Tensor):
        """The route's plan-free half (before the count all-gather and the replicas' wait)."""
        return expert_order(idx_TK, self.num_experts)

    def all_gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """tokens_ED: every rank's counts per expert (the one synchronisation the plan needs)."""
        return all_gather_counts(counts_E, self.group)

    def route(self, idx_TK: torch.Tensor, plan, *, local_E: torch.Tensor, grouped=None, dedup: bool | None = None,
              degrees: tuple = (1, 1)):
        """A :class:`~ds_fssdp.moe.routing.Route`, or with ``dedup`` (None: the dispatcher's) a
        :class:`DedupRoute` (collective: every rank of the group calls it, with the same ``dedup``
        and ``degrees``). Two hops at ``degrees`` other than (1, 1) stage the last hop by the relay
        rows' atoms (``moe/relay.py``: both hops chunked)."""
        r = route(idx_TK, plan, rank=self.rank, local_E=local_E, grouped=grouped)
        if not (self.dedup if dedup is None else dedup):
            return r
        T, K = idx_TK.shape
        dev = idx_TK.device
        traffic_DD = plan.traffic_DD() if isinstance(plan, DispatchPlan) else plan.sum(0).to("cpu", torch.long)
        D = traffic_DD.shape[0]
        dest_TK, pos_TK = slot_targets(r, T, K, traffic_DD[:self.rank].sum(0))
        G = self.ranks_per_node
        two_hops = 1 < G < D
        hop_dest_TK = relay_of(dest_TK, self.rank, G) if two_hops else dest_TK
        hops = []
        cuts = atom_cuts(*degrees) if two_hops and tuple(degrees) != (1, 1) else None
        for last in ((False, True) if two_hops else (True, )):
            if last and cuts is not None:  # stages: a relay row's atom in its source's block; A: local
                A = len(cuts) - 1
                relay_splits = hops[0].recv_splits
                own_T = torch.zeros(sum(relay_splits), dtype=torch.bool)
                own_T[sum(relay_splits[:self.rank]):sum(relay_splits[:self.rank + 1])] = True
                own_TK = own_T.to(dev).unsqueeze(1) & (hop_dest_TK == self.rank)  # this rank's own rows
                stage_TK = torch.where(own_TK, A, atom_of_rows(relay_splits, cuts).to(dev).unsqueeze(1))
                hop = hop_tables(hop_dest_TK, D, stage_TK=stage_TK, stages=A + 1)
                counts_DDA = all_gather_counts(hop.stage_splits.flatten().to(dev), self.group).t().view(D, D, A + 1)
                hop.uniq_DD = counts_DDA.sum(2)
                hop.recv_stage_splits = counts_DDA[:, self.rank]
            else:
                hop = hop_tables(hop_dest_TK, D)
                hop.uniq_DD = all_gather_counts(torch.tensor(hop.splits, dtype=torch.long, device=dev),
                                                self.group).t()
            hop.recv_splits = hop.uniq_DD[:, self.rank].tolist()
            fields = (pos_TK, ) if last else (dest_TK, pos_TK)  # a relay needs the final destinations
            hops.append(hop)
            entries = all_to_all(hop_entries(hop, *fields), hop.recv_splits, hop.splits, group=self.group)
            pos_TK = entries[:, -K:]
            if not last:
                hop_dest_TK = dest_TK = entries[:, :K]  # the relay: on to the final destinations in its node
        rows_UK, token_C = receive_tables(r, pos_TK, check=not pos_TK.is_cuda)
        return DedupRoute(route=r, hops=hops, rows_UK=rows_UK, token_C=token_C)

    def run(self, x_TH: torch.Tensor, weights_TK: torch.Tensor, r, *, expert_fn) -> torch.Tensor:
        """Send, compute, return, combine: out_TH."""
        if isinstance(r, DedupRoute):
            return dispatch_compute_combine_dedup(x_TH, weights_TK, r, expert_fn=expert_fn, exchange=self._exchange)
        return dispatch_compute_combine(x_TH, weights_TK, r, expert_fn=expert_fn, exchange=self._exchange)

    def run_pipelined(self, x_TH: torch.Tensor, weights_TK: torch.Tensor, r, *, experts,
                      degrees: tuple, side=None) -> torch.Tensor:
        """:meth:`run` with the exchange chunked at ``degrees`` (forward, backward) and pipelined
        with the expert compute (``moe/pipeline.py``); a :class:`DedupRoute` sends one row per
        (token, destination) in the chunks (two hops: both chunked, ``moe/relay.py``, the route
        staged at the same ``degrees``). ``side``: the layer's work beside the exchange
        (``moe/side.py``), or None."""
        if isinstance(r, DedupRoute) and len(r.hops) == 2:  # two hops, both chunked
            return relay_dispatch_compute_combine(x_TH, weights_TK, r, experts=experts, degrees=degrees,
                                                  groups=self.exchange, rank=self.rank, world=self.world,
                                                  exchange=self._exchange, side=side)
        if isinstance(r, DedupRoute):
            return pipelined_dispatch_compute_combine_dedup(x_TH, weights_TK, r, experts=experts, degrees=degrees,
                                                            groups=self.exchange, rank=self.rank, world=self.world,
                                                            exchange=self._exchange, side=side)
        return pipelined_dispatch_compute_combine(x_TH, weights_TK, r, experts=experts, degrees=degrees,
                                                  groups=self.exchange, rank=self.rank, world=self.world, side=side)

    def _exchange(self, x, out_splits, in_splits):
        if self.timings is None:
            return all_to_all(x, out_splits, in_splits, group=self.group)
        return self.timings.exchange(lambda y: all_to_all(y, out_splits, in_splits, group=self.group), x,
                                     out_splits, in_splits)

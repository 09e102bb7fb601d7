"""The token dispatcher of one sharded layer: route the gate's assignments by the dispatch plan and
run ``compute.dispatch_compute_combine`` over the uneven all-to-all (Megatron-Core's token
dispatcher: local index math, the exchange, the expert compute, the exchange back, the combine).

Legend: T tokens, K top-k, H hidden, E experts.

The route is split around the plan: :meth:`group` (the assignments grouped by expert) needs no
plan and runs before the count all-gather; :meth:`route` cuts it by the plan afterwards.
"""
from __future__ import annotations

import torch

from ds_fssdp.comm import all_gather_counts, all_to_all
from ds_fssdp.moe.compute import dispatch_compute_combine
from ds_fssdp.moe.pipeline import pipelined_dispatch_compute_combine
from ds_fssdp.moe.routing import expert_order, route


class TokenDispatcher:

    def __init__(self, *, group, rank: int, num_experts: int, exchange=None, world: int | None = None):
        """``exchange``: the chunked exchange's :class:`~ds_fssdp.moe.pipeline.ExchangeGroups`
        (``run_pipelined``); ``world``: the group's ranks."""
        self.group = group
        self.exchange = exchange
        self.world = world
        self.rank = rank
        self.num_experts = num_experts
        self.timings = None  # moe.timing.LayerTimings: each exchange timed when set

    def group_by_expert(self, idx_TK: torch.Tensor):
        """The route's plan-free half (before the count all-gather and the replicas' wait)."""
        return expert_order(idx_TK, self.num_experts)

    def all_gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """tokens_ED: every rank's counts per expert (the one synchronisation the plan needs)."""
        return all_gather_counts(counts_E, self.group)

    def route(self, idx_TK: torch.Tensor, plan, *, local_E: torch.Tensor, grouped=None):
        return route(idx_TK, plan, rank=self.rank, local_E=local_E, grouped=grouped)

    def run(self, x_TH: torch.Tensor, weights_TK: torch.Tensor, r, *, expert_fn) -> torch.Tensor:
        """Send, compute, return, combine: out_TH."""
        return dispatch_compute_combine(x_TH, weights_TK, r, expert_fn=expert_fn, exchange=self._exchange)

    def run_pipelined(self, x_TH: torch.Tensor, weights_TK: torch.Tensor, r, *, experts, degrees: tuple) -> torch.Tensor:
        """:meth:`run` with the exchange chunked at ``degrees`` (forward, backward) and pipelined
        with the expert compute (``moe/pipeline.py``)."""
        return pipelined_dispatch_compute_combine(x_TH, weights_TK, r, experts=experts, degrees=degrees,
                                                  groups=self.exchange, rank=self.rank, world=self.world)

    def _exchange(self, x, out_splits, in_splits):
        if self.timings is None:
            return all_to_all(x, out_splits, in_splits, group=self.group)
        return self.timings.exchange(lambda y: all_to_all(y, out_splits, in_splits, group=self.group), x,
                                     out_splits, in_splits)

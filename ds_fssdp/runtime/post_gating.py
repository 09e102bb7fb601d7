"""Replicas added after gating, on the critical path: FSSDP calibration and FasterMoE shadowing.

Legend: E experts, D ranks.

Each is a callable ``(shard, placement_ED, tokens_ED) -> extra_ED | None`` that a
:class:`ShardedExperts` calls once the actual ``tokens_ED`` are known; every rank computes the
same answer from the same all-gathered counts, so all of them run the extra gather.
"""
from __future__ import annotations

import math

import torch

from ds_fssdp.planner import dispatch
from ds_fssdp.planner.calibrate import calibrate
from ds_fssdp.planner.cost import CostModel


class Calibration:
    """Paper section 4.2: re-run placement on the actual loads with the budget left; adopt it if
    the modelled saving beats the modelled extra gather and that fits the latency budget (the
    layer's measured attention window when ``latency_budget`` is None), with fewer distinct
    experts when the first merge's gather does not fit (:func:`ds_fssdp.planner.calibrate`)."""

    def __init__(self, cost: CostModel, *, latency_budget: float | None = None):
        self.cost = cost
        self.latency_budget = latency_budget

    def __call__(self, shard, placement_ED: torch.Tensor, tokens_ED: torch.Tensor):
        budget = self.latency_budget if self.latency_budget is not None else shard.window_s
        mode = shard.options.dispatch_mode
        cal = calibrate(shard.owner_E, placement_ED, tokens_ED, shard.topology, self.cost,
                        overlap_degree=shard.overlap_degree, budget=shard.options.budget,
                        latency_budget=budget if budget is not None else math.inf,
                        dispatcher=lambda p, t, topo: dispatch(p, t, topo, mode=mode, cost=shard.cost))
        shard.post_gating_info = {"calibration": {"accepted": cal.accepted, "added_pairs": cal.added_pairs,
                                                  "saved_s": cal.saved_s, "extra_s": cal.extra_s,
                                                  "overlap_degree": cal.overlap_degree}}
        return cal.placement_ED & ~placement_ED if cal.accepted else None


class Shadowing:
    """FasterMoE: broadcast the experts whose modelled benefit exceeds broadcast + reduce to
    every rank (the planner's FasterMoE policy decides)."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, shard, placement_ED: torch.Tensor, tokens_ED: torch.Tensor):
        plan = self.policy.post_gating(shard.layer_index, shard.owner_E, placement_ED, tokens_ED=tokens_ED)
        extra_ED = plan.placement_ED & ~placement_ED
        shard.post_gating_info = {"shadowed": int(extra_ED.any(1).sum())}
        return extra_ED if bool(extra_ED.any()) else None

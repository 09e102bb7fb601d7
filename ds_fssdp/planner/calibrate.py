"""Calibration (paper section 4.2): after gating, with the actual loads, add replicas if worth it.

Legend: E experts, D ranks.

The placement gathered during the preceding attention came from predicted loads. With the actual
``tokens_ED`` known, Algorithm 1 runs again on the budget left and the result is merged into the
placement. The merged placement is adopted only if the modelled latency it saves exceeds the
modelled cost of the extra gather (which now sits on the critical path) and that cost fits the
latency budget.

When the merge's gather does not fit the latency budget, Algorithm 1 runs again with fewer
distinct experts, t found by bisection between 0 (nothing added) and t (over the budget): at most
ceil(log2 t) more merges, each kept when its gather fits, and the fitting merge of the largest t
tried is the candidate. On Algorithm 1's own pre-gating placement the top experts are already
everywhere and the first merge usually fits; on a placement that replicates where the tokens come
from (``joint``, ``cost``) the first merge must also complete the top experts on every rank, which
would refuse calibration where a smaller one pays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ds_fssdp.planner.cost import CostModel
from ds_fssdp.planner.dispatch import dispatch
from ds_fssdp.planner.materialize import materialize
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.topology import Topology


@dataclass(frozen=True)
class Calibration:
    placement_ED: torch.Tensor  # the placement to use (merged if accepted, else the input)
    accepted: bool
    added_pairs: int  # replicas the merge adds (0 when rejected)
    saved_s: float  # modelled layer time saved by the merge
    extra_s: float  # modelled time of the extra gather
    overlap_degree: int  # distinct experts (t) of the candidate merge: the one that fit, else the first tried


def calibrate(owner_E: torch.Tensor, placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology,
              cost: CostModel, *, overlap_degree: int, budget: int, latency_budget: float,
              dispatcher: Callable = dispatch, materializer: Callable = materialize) -> Calibration:
    """``materializer``: Algorithm 1 (any implementation of ``materialize``'s signature)."""
    owner_E = owner_E.to("cpu", torch.long)
    placement_ED = placement_ED.to("cpu", torch.bool)
    load_E = tokens_ED.sum(1)
    shard_ED = shard_placement(owner_E, topology.num_ranks)

    def merge(t):
        """(merged_ED, new_ED, extra gather) of Algorithm 1 at t over the placement; None: adds nothing."""
        merged_ED = materializer(owner_E, load_E, topology, overlap_degree=t, budget=budget, base_ED=placement_ED)
        new_ED = merged_ED & ~placement_ED
        if not bool(new_ED.any()):
            return None
        return merged_ED, new_ED, cost.gather_time(owner_E, shard_ED | new_ED)

    t = overlap_degree
    candidate = merge(t)
    if candidate is None:
        return Calibration(placement_ED, False, 0, 0.0, 0.0, t)
    if candidate[2] > latency_budget:
        fit, lo, hi = None, 0, t  # a merge at lo fits (or adds nothing), at hi it does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            smaller = merge(mid)
            if smaller is None or smaller[2] <= latency_budget:
                lo, fit = mid, smaller
            else:
                hi = mid
        if fit is None:
            return Calibration(placement_ED, False, 0, 0.0, candidate[2], t)
        candidate, t = fit, lo
    merged_ED, new_ED, extra = candidate
    before = cost.layer_time(dispatcher(placement_ED, tokens_ED, topology))
    after = cost.layer_time(dispatcher(merged_ED, tokens_ED, topology))
    saved = before - after
    if saved > extra:
        return Calibration(merged_ED, True, int(new_ED.sum()), saved, extra, t)
    return Calibration(placement_ED, False, 0, saved, extra, t)

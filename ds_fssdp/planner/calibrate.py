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

A merge can only use the slots the pre-gating placement left free, and a placement that fills
every slot (``joint-fill``) leaves calibration nothing. So a second candidate may evict: Algorithm 1
on the actual loads from the shard (the placement calibration would have made with no pre-gating
guess), its replicas the placement lacks gathered now, and on a rank whose budget that overflows
the pre-gated replicas it does not place are evicted, the least loaded first. An evicted replica
was gathered under the attention and is not used: no tokens go to it, it is not reduced and not
re-gathered for the backward. Each candidate's t is bisected on the latency budget the same way,
and the one with the larger modelled net saving (saved - extra gather) is adopted when that is
positive.
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
    placement_ED: torch.Tensor  # the placement to use (the adopted candidate's, else the input)
    accepted: bool
    added_pairs: int  # replicas the adopted candidate adds (0 when rejected)
    saved_s: float  # modelled layer time saved by the best candidate
    extra_s: float  # modelled time of its extra gather
    overlap_degree: int  # distinct experts (t) of the best candidate: the one that fit, else the first tried
    evicted_pairs: int = 0  # pre-gated replicas the adopted candidate drops (unused, not reduced)


def calibrate(owner_E: torch.Tensor, placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology,
              cost: CostModel, *, overlap_degree: int, budget: int, latency_budget: float,
              dispatcher: Callable = dispatch, materializer: Callable = materialize) -> Calibration:
    """``materializer``: Algorithm 1 (any implementation of ``materialize``'s signature)."""
    owner_E = owner_E.to("cpu", torch.long)
    placement_ED = placement_ED.to("cpu", torch.bool)
    load_E = tokens_ED.sum(1)
    shard_ED = shard_placement(owner_E, topology.num_ranks)

    def finish(final_ED):
        """(final_ED, new_ED, extra gather) of a candidate; None: it adds nothing."""
        new_ED = final_ED & ~placement_ED
        return (final_ED, new_ED, cost.gather_time(owner_E, shard_ED | new_ED)) if bool(new_ED.any()) else None

    def merge(t):
        """Algorithm 1 at t into the slots the placement left free."""
        return finish(materializer(owner_E, load_E, topology, overlap_degree=t, budget=budget, base_ED=placement_ED))

    def evict(t):
        """Algorithm 1 at t from the shard, over the placement, evicting what overflows a budget."""
        star_ED = materializer(owner_E, load_E, topology, overlap_degree=t, budget=budget)
        return finish(evict_to_budget(placement_ED | star_ED, placement_ED & ~star_ED & ~shard_ED, shard_ED,
                                      load_E, budget))

    fitted = [_fit(candidate_of, overlap_degree, latency_budget) for candidate_of in (merge, evict)]
    fits = [(c, t) for c, t in fitted if c is not None and c[2] <= latency_budget]
    if not fits:  # nothing to add, or no gather fits: what the merge found
        merged, _ = fitted[0]
        return Calibration(placement_ED, False, 0, 0.0, 0.0 if merged is None else merged[2], overlap_degree)
    before = cost.layer_time(dispatcher(placement_ED, tokens_ED, topology))
    best = None  # (net, saved, candidate, t): the merge first, so it wins a tie
    for i, (candidate, t) in enumerate(fits):
        if i and torch.equal(candidate[0], fits[0][0][0]):
            continue  # the same placement (the merge found free slots enough)
        saved = before - cost.layer_time(dispatcher(candidate[0], tokens_ED, topology))
        net = saved - candidate[2]
        if best is None or net > best[0]:
            best = (net, saved, candidate, t)
    net, saved, (final_ED, new_ED, extra), t = best
    if not net > 0:
        return Calibration(placement_ED, False, 0, saved, extra, t)
    return Calibration(final_ED, True, int(new_ED.sum()), saved, extra, t, int((placement_ED & ~final_ED).sum()))


def leaves_room(placement_ED: torch.Tensor, budget: int) -> bool:
    """Whether calibration may still change ``placement_ED``: with a budget, some rank lacks an
    expert (into a free slot, or in place of a pre-gated replica it evicts); a placement that
    holds every expert on every rank leaves it nothing."""
    return budget > 0 and not bool(placement_ED.to("cpu", torch.bool).all())


def _fit(candidate_of: Callable, t: int, latency_budget: float) -> tuple:
    """``(candidate, t)``: ``candidate_of(t)`` when its gather fits the latency budget (or it adds
    nothing: None); else the fitting candidate of the largest t bisected between 0 and t, or the
    one at t (over the budget) when none fits."""
    candidate = candidate_of(t)
    if candidate is None or candidate[2] <= latency_budget:
        return candidate, t
    fit, lo, hi = None, 0, t  # a candidate at lo fits (or adds nothing), at hi it does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        smaller = candidate_of(mid)
        if smaller is None or smaller[2] <= latency_budget:
            lo, fit = mid, smaller
        else:
            hi = mid
    return (candidate, t) if fit is None else (fit, lo)


def evict_to_budget(merged_ED: torch.Tensor, evictable_ED: torch.Tensor, shard_ED: torch.Tensor,
                    load_E: torch.Tensor, budget: int) -> torch.Tensor:
    """``merged_ED`` with, on each rank holding more than ``budget`` replicas, the overflow removed
    from ``evictable_ED``'s replicas on it, the least loaded expert first (ties: the lower expert
    id). Raises if a rank's evictable replicas cannot cover its overflow."""
    over_D = ((merged_ED & ~shard_ED).sum(0) - budget).clamp(min=0)
    if not bool(over_D.any()):
        return merged_ED
    order_E = torch.argsort(load_E.to("cpu", torch.float64), stable=True)  # least loaded first
    evictable_sorted_ED = evictable_ED[order_E]
    short_D = over_D - evictable_sorted_ED.sum(0)
    if bool((short_D > 0).any()):
        d = int(torch.nonzero(short_D > 0)[0])
        raise ValueError(f"rank {d}: {int(over_D[d])} replicas over the budget ({budget}) but only "
                         f"{int(over_D[d] - short_D[d])} evictable")
    # on each rank, the first over_D evictable replicas in that order
    drop_sorted_ED = evictable_sorted_ED & (evictable_sorted_ED.cumsum(0) <= over_D)
    drop_ED = torch.zeros_like(merged_ED)
    drop_ED[order_E] = drop_sorted_ED
    return merged_ED & ~drop_ED

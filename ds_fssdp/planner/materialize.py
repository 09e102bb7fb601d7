"""Algorithm 1, sparse materialization: the ephemeral placement P' of one MoE layer.

Legend: E experts, D ranks, N nodes.

P' starts from the shard placement P and adds replicas of the hottest experts:

* at most ``t`` distinct experts get replicas (the overlap degree: what the gather can move while
  the preceding attention computes), at most ``m`` added replicas per rank (the budget);
* if t <= m every one of the top-t experts is materialized on every rank;
* otherwise the D * m replica slots are shared among the top-t experts by load, hottest first
  (longest-processing-time first): ``assign_slots_by_load`` gives an expert its proportional share
  of the slots left (slots an expert cannot use flow to the next ones);
* each replica goes first to a node that does not hold the expert yet (so that node's tokens stay
  inside it), then to the rank with the most free slots, then the least predicted load, then the
  lowest rank id. Deterministic: the same inputs give the same placement on every rank.
"""
from __future__ import annotations

import math

import torch

from ds_fssdp.planner import fast
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.topology import Topology


def materialize(owner_E: torch.Tensor, load_E: torch.Tensor, topology: Topology, *, overlap_degree: int,
                budget: int, base_ED: torch.Tensor | None = None) -> torch.Tensor:
    """Return placement_ED (bool [E, D]) containing the shard placement of ``owner_E``.

    ``base_ED`` (calibration): extend this placement instead of the shard, with what is left of
    each rank's budget. Runs in C when the extension is built (same result as the reference)."""
    if fast.AVAILABLE:
        _check(owner_E, load_E, overlap_degree, budget)
        return fast.materialize_alg1(owner_E, load_E, topology, overlap_degree, budget, base_ED)
    return materialize_reference(owner_E, load_E, topology, overlap_degree=overlap_degree, budget=budget,
                                 base_ED=base_ED)


def _check(owner_E, load_E, overlap_degree, budget) -> None:
    if load_E.numel() != owner_E.numel():
        raise ValueError(f"load_E has {load_E.numel()} entries, expected {owner_E.numel()}")
    if overlap_degree < 0 or budget < 0:
        raise ValueError(f"overlap_degree ({overlap_degree}) and budget ({budget}) must be >= 0")


def materialize_reference(owner_E: torch.Tensor, load_E: torch.Tensor, topology: Topology, *, overlap_degree: int,
                          budget: int, base_ED: torch.Tensor | None = None) -> torch.Tensor:
    """Algorithm 1 in Python: the specification the C version is tested against."""
    owner_E = owner_E.to("cpu", torch.long)
    num_experts, num_ranks = owner_E.numel(), topology.num_ranks
    load_E = load_E.to("cpu", torch.float64).reshape(-1)
    _check(owner_E, load_E, overlap_degree, budget)
    shard_ED = shard_placement(owner_E, num_ranks)
    placement_ED = shard_ED.clone() if base_ED is None else base_ED.to("cpu", torch.bool) | shard_ED

    t = min(overlap_degree, num_experts)
    m = min(budget, t)
    total = float(load_E.sum())
    if t == 0 or m == 0 or num_ranks == 1 or total <= 0:
        return placement_ED
    # Hottest first; ties go to the lower expert id (stable sort).
    top = torch.sort(-load_E, stable=True).indices[:t]
    if t <= m and base_ED is None:
        placement_ED[top] = True
        return placement_ED

    node_D = topology.node_D()
    free_D = (m - (placement_ED & ~shard_ED).sum(0)).clamp(min=0)
    rank_load_D = torch.zeros(num_ranks, dtype=torch.float64).index_add_(0, owner_E, load_E)
    slots_left = int(free_D.sum())
    load_left = float(load_E[top].sum())
    for e in top.tolist():
        load = float(load_E[e])
        if slots_left == 0 or load_left <= 0:
            break
        n = assign_slots_by_load(load, load_left, slots_left)
        load_left -= load
        for _ in range(n):
            d = _pick_rank(placement_ED[e], free_D, rank_load_D, node_D, topology.num_nodes)
            if d is None:
                break
            placement_ED[e, d] = True
            free_D[d] -= 1
            slots_left -= 1
    return placement_ED


def assign_slots_by_load(load: float, load_left: float, slots_left: int) -> int:
    """Replicas for an expert of ``load``: its share of the slots left (the caller stops when the
    expert is on every rank or no rank has a free slot)."""
    return min(slots_left, int(math.floor(slots_left * load / load_left + 0.5)))


def _pick_rank(holds_D: torch.Tensor, free_D: torch.Tensor, rank_load_D: torch.Tensor, node_D: torch.Tensor,
               num_nodes: int) -> int | None:
    candidates = (~holds_D) & (free_D > 0)
    if not bool(candidates.any()):
        return None
    node_holds = torch.zeros(num_nodes, dtype=torch.bool)
    node_holds[node_D[holds_D]] = True
    best, best_key = None, None
    for d in torch.nonzero(candidates).flatten().tolist():
        key = (bool(node_holds[node_D[d]]), -int(free_D[d]), float(rank_load_D[d]), d)
        if best_key is None or key < best_key:
            best, best_key = d, key
    return best

"""Algorithm 1 (sparse materialization) with one sort per expert instead of one scan per replica.

Legend: E experts, D ranks, N nodes.

Same contract and the same placements as :func:`ds_fssdp.planner.materialize` (checked by
tests/test_sim.py on random instances, with and without ``base_ED``). The planner picks each
replica with a scan over all ranks, keyed (node already holds the expert, -free slots, predicted
rank load, rank id). Within one expert's picks the rank loads never change and only the picked
rank's free slots do, so the picks come out in a closed order: first, one rank per node that
lacks the expert (each such node's best rank by the key, nodes in the order of those ranks'
keys), then every other candidate by the key. The simulator uses this where calibration re-runs
Algorithm 1 on hundreds of replicas per layer.
"""
from __future__ import annotations

import numpy as np
import torch

from ds_fssdp.planner.materialize import assign_slots_by_load
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.topology import Topology


def vector_materialize(owner_E: torch.Tensor, load_E: torch.Tensor, topology: Topology, *, overlap_degree: int,
                       budget: int, base_ED: torch.Tensor | None = None) -> torch.Tensor:
    owner_E = owner_E.to("cpu", torch.long)
    num_experts, num_ranks = owner_E.numel(), topology.num_ranks
    load_E = load_E.to("cpu", torch.float64).reshape(-1)
    if load_E.numel() != num_experts:
        raise ValueError(f"load_E has {load_E.numel()} entries, expected {num_experts}")
    if overlap_degree < 0 or budget < 0:
        raise ValueError(f"overlap_degree ({overlap_degree}) and budget ({budget}) must be >= 0")
    shard_ED = shard_placement(owner_E, num_ranks)
    placement_ED = shard_ED.clone() if base_ED is None else base_ED.to("cpu", torch.bool) | shard_ED
    t = min(overlap_degree, num_experts)
    m = min(budget, t)
    total = float(load_E.sum())
    if t == 0 or m == 0 or num_ranks == 1 or total <= 0:
        return placement_ED
    top = torch.sort(-load_E, stable=True).indices[:t]
    if t <= m and base_ED is None:
        placement_ED[top] = True
        return placement_ED

    P = placement_ED.numpy().copy()
    node_D = topology.node_D().numpy()
    free_D = np.maximum(m - (P & ~shard_ED.numpy()).sum(0), 0).astype(np.int64)
    rank_load_D = np.zeros(num_ranks)
    np.add.at(rank_load_D, owner_E.numpy(), load_E.numpy())
    slots_left = int(free_D.sum())
    load_left = float(load_E[top].sum())
    for e in top.tolist():
        load = float(load_E[e])
        if slots_left == 0 or load_left <= 0:
            break
        n = assign_slots_by_load(load, load_left, slots_left)
        load_left -= load
        if n == 0:
            continue
        cand = np.nonzero(~P[e] & (free_D > 0))[0]
        if cand.size == 0:
            continue
        # Rank key (-free, load, id), as the planner's scan compares them.
        order = cand[np.lexsort((cand, rank_load_D[cand], -free_D[cand]))]
        holds_N = np.zeros(topology.num_nodes, dtype=bool)
        holds_N[node_D[P[e]]] = True
        first = np.zeros(cand.size, dtype=bool)
        seen_N = holds_N.copy()
        for i, d in enumerate(order):  # the best rank of each node lacking e, in key order
            if not seen_N[node_D[d]]:
                seen_N[node_D[d]] = True
                first[i] = True
        picks = np.concatenate([order[first], order[~first]])[:n]
        P[e, picks] = True
        free_D[picks] -= 1
        slots_left -= picks.size
    return torch.from_numpy(P)

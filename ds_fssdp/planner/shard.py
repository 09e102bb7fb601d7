"""Shard placements: which rank owns each expert (its parameters and optimizer states).

Legend: E experts, D ranks.
"""
from __future__ import annotations

import torch

from ds_fssdp.topology import Topology


def homogeneous_owner(num_experts: int, num_ranks: int) -> torch.Tensor:
    """Even sharding: contiguous blocks of experts per rank, ``owner_E[e] = e * D // E``.

    With E divisible by D every rank owns E / D consecutive experts (the expert-parallel layout);
    otherwise shard sizes differ by at most one, and with E < D some ranks own none.
    """
    return torch.arange(num_experts, dtype=torch.long) * num_ranks // num_experts


def initial_ownership(num_experts: int, *, group_size: int, group_rank: int) -> tuple:
    """``(owner_E, owned_E)``: who owns each expert of a layer when training starts, and the experts
    (ascending) the rank at ``group_rank`` of its FSSDP group owns. Every FSSDP group owns its own
    copy the same way, so a rank owns the experts of its position in its group. The one decision
    the stage (at ``ds_fssdp.initialize``) and the loaders (``integrations/hf_load.py``, which read
    only these experts) share."""
    if not 0 <= group_rank < group_size:
        raise ValueError(f"group_rank ({group_rank}) must be in [0, {group_size})")
    owner_E = homogeneous_owner(num_experts, group_size)
    return owner_E, torch.nonzero(owner_E == group_rank).flatten()


def shard_placement(owner_E: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """The shard placement P as a bool [E, D] matrix (one True per row)."""
    placement_ED = torch.zeros(owner_E.numel(), num_ranks, dtype=torch.bool)
    placement_ED[torch.arange(owner_E.numel()), owner_E] = True
    return placement_ED


def heterogeneous_sharding(load_LE: torch.Tensor, topology: Topology, *, overlap_degree: int) -> torch.Tensor:
    """Algorithm 2: owners of every expert of every layer (long [L, E]) with equal slots per rank.

    Each rank gets the same number of expert slots summed over layers (L * E / D; when that does
    not divide, the first ranks get one more), so memory stays uniform while a layer's shard sizes
    may differ. Underloaded experts (outside their layer's top-t, the ones materialization never
    replicates) are placed first, layers in order of their largest underloaded load: each goes to
    the least-loaded node with a free slot, then the least-loaded rank of that node with a free
    slot; ties prefer fewer free slots, then lower ids. Loads are this layer's, since layers run
    one after another. The overloaded experts fill the remaining slots by the same rule.
    Deterministic.
    """
    load_LE = load_LE.to("cpu", torch.float64)
    L, E = load_LE.shape
    D, N = topology.num_ranks, topology.num_nodes
    if overlap_degree < 0:
        raise ValueError(f"overlap_degree ({overlap_degree}) must be >= 0")
    total = L * E
    free_D = torch.full((D, ), total // D, dtype=torch.long)
    free_D[:total % D] += 1
    node_D = topology.node_D()
    t = min(overlap_degree, E)
    order_LE = torch.sort(-load_LE, dim=1, stable=True).indices  # per layer, hottest first
    top_LE = order_LE[:, :t]
    cold_LE = order_LE[:, t:]
    owner_LE = torch.full((L, E), -1, dtype=torch.long)
    rank_load_LD = torch.zeros(L, D, dtype=torch.float64)

    def place(l: int, e: int) -> None:
        node_load = torch.zeros(N, dtype=torch.float64).index_add_(0, node_D, rank_load_LD[l])
        node_free = torch.zeros(N, dtype=torch.long).index_add_(0, node_D, free_D)
        n = min((i for i in range(N) if node_free[i] > 0),
                key=lambda i: (float(node_load[i]), int(node_free[i]), i))
        d = min((r for r in topology.ranks_of(n) if free_D[r] > 0),
                key=lambda r: (float(rank_load_LD[l, r]), int(free_D[r]), r))
        owner_LE[l, e] = d
        free_D[d] -= 1
        rank_load_LD[l, d] += load_LE[l, e]

    cold_max_L = load_LE.gather(1, cold_LE).amax(1) if cold_LE.shape[1] else torch.zeros(L, dtype=torch.float64)
    for l in torch.sort(-cold_max_L, stable=True).indices.tolist():
        for e in cold_LE[l].tolist():
            place(l, e)
    for l in range(L):
        for e in top_LE[l].tolist():
            place(l, e)
    return owner_LE

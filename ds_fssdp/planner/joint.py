"""Joint materialization: replicas where the tokens come from, sized for the balancing dispatcher.

Legend: E experts, D ranks, N nodes, G ranks per node.

Algorithm 1 sees per-expert totals only; its replicas go to nodes lacking the expert, one at a
time. Balancing then needs each node to hold enough capacity for the tokens it produces of each
hot expert, or tokens cross nodes to find room. With the predicted ``tokens_ED`` (the window mean
of the all-gathered counts), this variant is longest-processing-time first at node granularity:

* F[e, n]: predicted tokens of expert e produced in node n; tau = mean rows per rank;
* first cover: a node producing tokens of an expert it lacks gets a holder (hottest first), since
  otherwise all those tokens cross nodes and the node has to import others to stay balanced;
* then repeatedly give one more holder to the (expert, node) with the largest per-holder load
  F[e, n] / h[e, n], on the rank of that node with the most free slots, then the least owned
  load, then the lowest id;
* stop when that load is below ``stop * tau`` (``STOP`` by default: a further replica balances
  nothing), when no rank has a free slot, or when the next expert would exceed ``overlap_degree``
  distinct replicated experts. ``stop=0`` fills every slot the t allows: the placement by time
  (``planner/overlap.py``) takes it, and its search over t is what stops it there.

Same constraints as Algorithm 1 (shard kept, <= m added per rank, <= t distinct experts),
deterministic.
"""
from __future__ import annotations

import torch

from ds_fssdp.planner import fast
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.topology import Topology

# Stop adding holders once the largest per-holder load is below this fraction of the mean rank
# load: measured on the shared trace, 1/4 keeps nearly every slot useful (0.5 leaves balance on the
# table, 0 adds replicas that only cost traffic).
STOP = 0.25


def joint_materialize(owner_E: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *, overlap_degree: int,
                      budget: int, base_ED: torch.Tensor | None = None, stop: float = STOP) -> torch.Tensor:
    """Return placement_ED (bool [E, D]); in C when the extension is built (same result)."""
    if base_ED is None and fast.AVAILABLE:  # (shapes checked there)
        _check_knobs(overlap_degree, budget, stop)
        return fast.materialize_joint(owner_E, tokens_ED, topology, overlap_degree, budget, float(stop))
    return joint_materialize_reference(owner_E, tokens_ED, topology, overlap_degree=overlap_degree, budget=budget,
                                       base_ED=base_ED, stop=stop)


def _check_knobs(overlap_degree: int, budget: int, stop: float) -> None:
    if overlap_degree < 0 or budget < 0:
        raise ValueError(f"overlap_degree ({overlap_degree}) and budget ({budget}) must be >= 0")
    if not stop >= 0.0:
        raise ValueError(f"stop ({stop!r}) must be >= 0")


def joint_materialize_reference(owner_E: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *,
                                overlap_degree: int, budget: int, base_ED: torch.Tensor | None = None,
                                stop: float = STOP) -> torch.Tensor:
    """The Python specification the C version is tested against."""
    owner_E = owner_E.to("cpu", torch.long)
    tokens_ED = tokens_ED.to("cpu", torch.float64)
    E, D = tokens_ED.shape
    if owner_E.numel() != E or D != topology.num_ranks:
        raise ValueError(f"tokens_ED {tuple(tokens_ED.shape)} does not match {owner_E.numel()} experts on "
                         f"{topology.num_ranks} ranks")
    _check_knobs(overlap_degree, budget, stop)
    finite_ED = torch.isfinite(tokens_ED)
    if not bool(finite_ED.all()):
        e, d = (int(i) for i in torch.nonzero(~finite_ED)[0])
        raise ValueError(f"tokens_ED[{e}, {d}] = {float(tokens_ED[e, d])!r} is not finite")
    shard_ED = shard_placement(owner_E, D)
    placement_ED = shard_ED.clone() if base_ED is None else base_ED.to("cpu", torch.bool) | shard_ED
    total = float(tokens_ED.sum())
    t = min(overlap_degree, E)
    if t == 0 or budget == 0 or D == 1 or total <= 0:
        return placement_ED
    N = topology.num_nodes
    node_D = topology.node_D()
    F_EN = torch.zeros(E, N, dtype=torch.float64).index_add_(1, node_D, tokens_ED)
    tau = total / D
    free_D = (budget - (placement_ED & ~shard_ED).sum(0)).clamp(min=0)
    owned_load_D = torch.zeros(D, dtype=torch.float64).index_add_(0, owner_E, tokens_ED.sum(1))
    replicated_E = (placement_ED & ~shard_ED).any(1)
    while True:
        h_EN = torch.zeros(E, N, dtype=torch.float64).index_add_(1, node_D, placement_ED.double())
        # A node can take a holder of e if one of its ranks lacks e and has a free slot.
        open_ED = ~placement_ED & (free_D > 0)
        open_EN = torch.zeros(E, N, dtype=torch.float64).index_add_(1, node_D, open_ED.double()) > 0
        if int(replicated_E.sum()) >= t:
            open_EN &= replicated_E[:, None]
        per_holder_EN = F_EN / h_EN.clamp(min=1.0)
        # Cover first: a node lacking the expert sends all its tokens of it across nodes.
        per_holder_EN = torch.where((h_EN == 0) & (F_EN > 0), per_holder_EN + total, per_holder_EN)
        per_holder_EN[~open_EN] = -1.0
        best = int(torch.argmax(per_holder_EN))  # ties: the lowest (expert, node)
        e, n = divmod(best, N)
        load = float(per_holder_EN[e, n])
        if load <= 0.0 or load < stop * tau:  # nothing (or too little) left to balance
            return placement_ED
        ranks = [d for d in topology.ranks_of(n) if bool(open_ED[e, d])]
        d = min(ranks, key=lambda r: (-int(free_D[r]), float(owned_load_D[r]), r))
        placement_ED[e, d] = True
        free_D[d] -= 1
        replicated_E[e] = True

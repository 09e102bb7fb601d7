"""Rename the ranks of a new shard placement so that as few experts as possible move.

Legend: X rows (layers, or one layer), E experts, D ranks, N nodes.

A placement algorithm that sees only loads (LPT in SmartMoE, Algorithm 2 in FSSDP) treats ranks
(and, with ``keep_nodes``, nodes) as interchangeable, so any renaming of its answer balances the
same. Picking the renaming that keeps the most experts on their current owner cuts the migration
that the placement puts on the critical path. Greedy matching on the overlap counts, largest first,
ties to the lower ids: deterministic, and within a few experts of an optimal assignment in
practice.
"""
from __future__ import annotations

import torch

from ds_fssdp.topology import Topology


def relabel_owner(old_owner_XE: torch.Tensor, new_owner_XE: torch.Tensor, topology: Topology, *,
                  keep_nodes: bool) -> torch.Tensor:
    """Return ``new_owner_XE`` with its ranks renamed to keep experts on ``old_owner_XE``.

    ``keep_nodes``: rename only by permuting nodes and ranks inside a node (the new placement's
    node structure matters, as in Algorithm 2); otherwise any permutation of ranks. A rank is only
    renamed to a rank that owns as many experts (summed over X) in ``old_owner_XE`` as it does in
    ``new_owner_XE``, so no rank's memory changes (when E is not a multiple of D some ranks hold one
    more expert); nodes likewise only swap with nodes of the same multiset of counts. If the two
    placements' counts are not a permutation of each other, any renaming is allowed."""
    old = old_owner_XE.to("cpu", torch.long).reshape(-1)
    new = new_owner_XE.to("cpu", torch.long).reshape(-1)
    D, G, N = topology.num_ranks, topology.ranks_per_node, topology.num_nodes
    overlap_DD = torch.zeros(D * D, dtype=torch.long).index_add_(0, new * D + old, torch.ones_like(new)).view(D, D)
    new_count_D = torch.bincount(new, minlength=D)
    old_count_D = torch.bincount(old, minlength=D)
    if not torch.equal(torch.sort(new_count_D).values, torch.sort(old_count_D).values):
        # The memory layout changes anyway (Algorithm 2 leaving an uneven homogeneous start).
        new_count_D = old_count_D = torch.zeros(D, dtype=torch.long)
    same_DD = new_count_D[:, None] == old_count_D[None, :]
    rename_D = torch.full((D, ), -1, dtype=torch.long)
    if keep_nodes:
        node_overlap_NN = overlap_DD.view(N, G, N, G).sum((1, 3))
        new_sig = [sorted(new_count_D[n * G:(n + 1) * G].tolist()) for n in range(N)]
        old_sig = [sorted(old_count_D[n * G:(n + 1) * G].tolist()) for n in range(N)]
        node_ok_NN = torch.tensor([[new_sig[a] == old_sig[b] for b in range(N)] for a in range(N)])
        for a, b in _greedy_match(node_overlap_NN, node_ok_NN):
            block = overlap_DD[a * G:(a + 1) * G, b * G:(b + 1) * G]
            for ra, rb in _greedy_match(block, same_DD[a * G:(a + 1) * G, b * G:(b + 1) * G]):
                rename_D[a * G + ra] = b * G + rb
    else:
        for a, b in _greedy_match(overlap_DD, same_DD):
            rename_D[a] = b
    assert bool((rename_D >= 0).all()) and torch.unique(rename_D).numel() == D
    return rename_D[new_owner_XE.to("cpu", torch.long)]


def _greedy_match(score_AB: torch.Tensor, ok_AB: torch.Tensor) -> list:
    """Pairs (a, b) with ``ok_AB[a, b]`` covering every row and column once, highest score first
    (ties: lower a, b). ``ok_AB`` must be an equivalence between rows and columns (complete within
    classes), so the greedy always completes."""
    n = score_AB.shape[0]
    order = sorted((-int(score_AB[a, b]), a, b) for a in range(n) for b in range(n) if bool(ok_AB[a, b]))
    used_a, used_b, pairs = set(), set(), []
    for _, a, b in order:
        if a not in used_a and b not in used_b:
            used_a.add(a)
            used_b.add(b)
            pairs.append((a, b))
    return pairs


def moved_copies(old_owner_LE: torch.Tensor, new_owner_LE: torch.Tensor) -> torch.Tensor:
    """long [M, 4] rows (layer, expert, old owner, new owner) for every expert whose owner changed."""
    changed = torch.nonzero(old_owner_LE != new_owner_LE)
    l, e = changed[:, 0], changed[:, 1]
    return torch.stack([l, e, old_owner_LE[l, e], new_owner_LE[l, e]], 1)

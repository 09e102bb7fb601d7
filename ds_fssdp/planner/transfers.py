"""Who sends which expert chunk to whom in the sparse collectives (pure index math).

Legend: E experts, D ranks, S experts owned by this rank, R replicas this rank receives.

SparseAllGather(P -> P') sends every added pair (e, d) of P' \\ P from the owner of e to d: one
chunk per pair, so the volume is |P' \\ P| chunks (Eq. 4). SparseReduceScatter(P' -> P) is the
same exchange reversed, with the owner summing what it receives. Both run as one all-to-all with
splits; every rank derives the same layout from the same (owner_E, placement_ED), so the two ends
agree on the order of the chunks without talking.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GatherLayout:
    """This rank's part of one SparseAllGather (and, reversed, of its SparseReduceScatter)."""

    owned_E: torch.Tensor  # long [S]: experts this rank owns, ascending (the row order of its shard)
    send_rows: torch.Tensor  # long [n_send]: owned rows to send, grouped by destination, then expert
    send_splits: list  # [D] chunks to each destination
    replica_E: torch.Tensor  # long [R]: experts received, grouped by source rank, then expert
    recv_splits: list  # [D] chunks from each source
    added_pairs: int  # |P' \ P| over the whole group

    @property
    def local_E(self) -> torch.Tensor:
        """Experts this rank computes this iteration: owned, then replicas (its compute slots)."""
        return torch.cat([self.owned_E, self.replica_E])


def gather_layout(owner_E: torch.Tensor, placement_ED: torch.Tensor, rank: int) -> GatherLayout:
    owner_E = owner_E.to("cpu", torch.long)
    placement_ED = placement_ED.to("cpu", torch.bool)
    num_experts, num_ranks = placement_ED.shape
    experts = torch.arange(num_experts)
    if not bool(placement_ED[experts, owner_E].all()):
        raise ValueError("placement_ED must contain the shard placement (every owner holds its expert)")
    added_ED = placement_ED.clone()
    added_ED[experts, owner_E] = False

    owned_E = torch.nonzero(owner_E == rank).flatten()
    row_of_E = torch.full((num_experts,), -1, dtype=torch.long)
    row_of_E[owned_E] = torch.arange(owned_E.numel())

    mine_ED = added_ED & (owner_E == rank)[:, None]  # chunks this rank sends: [e, destination]
    dst_e = torch.nonzero(mine_ED.t())  # (destination, expert), destination-major, expert ascending
    send_rows = row_of_E[dst_e[:, 1]]
    send_splits = mine_ED.sum(0).tolist()

    to_me_E = added_ED[:, rank]
    src_e = torch.stack([owner_E[to_me_E], experts[to_me_E]], 1)
    order = torch.argsort(src_e[:, 0] * num_experts + src_e[:, 1])
    replica_E = src_e[order, 1]
    recv_splits = torch.bincount(owner_E[to_me_E], minlength=num_ranks).tolist()
    return GatherLayout(owned_E=owned_E, send_rows=send_rows, send_splits=send_splits, replica_E=replica_E,
                        recv_splits=recv_splits, added_pairs=int(added_ED.sum()))

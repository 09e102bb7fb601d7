"""Who sends which expert chunk to whom in the sparse collectives (pure index math).

Legend: E experts, D ranks, N nodes, S experts owned by this rank, R replicas this rank holds.

SparseAllGather(P -> P') delivers every added pair (e, d) of P' \\ P; each added replica receives
its chunk exactly once, so the volume is |P' \\ P| chunks (Eq. 4). Topology-aware (section 3.3):

* phase 1: the owner sends the chunk to each added holder in its own node (intra-node) and to one
  relay per other node that needs it (inter-node: the chunk enters each node once);
* phase 2: each relay forwards it to the other added holders of its node (intra-node).

SparseReduceScatter(P' -> P) runs the phases in reverse: holders send their gradient to their
node's relay, which sums it into its own (phase 2 reversed: one partial sum per node), then relays
and the owner node's holders send to the owner (phase 1 reversed). Every phase is one all-to-all
with splits; every rank derives the same plan from (owner_E, placement_ED), so both ends of each
transfer agree on the order of the chunks without talking. With ``hierarchical=False`` (or one
node) there is only phase 1, owner to every added holder.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_fssdp.topology import Topology


@dataclass(frozen=True)
class Phase:
    """This rank's part of one phase of the gather (the reduce uses it reversed)."""

    send_rows: torch.Tensor  # long [n_send]: rows to send (owned rows in phase 1, replica rows in phase 2)
    send_splits: list  # [D] chunks to each destination
    recv_rows: torch.Tensor  # long [n_recv]: replica rows the received chunks fill
    recv_splits: list  # [D] chunks from each source
    from_replicas: bool  # phase 2: the sent rows are replica rows (relays forwarding)


@dataclass(frozen=True)
class GatherLayout:
    owned_E: torch.Tensor  # long [S]: experts this rank owns, ascending (the row order of its shard)
    replica_E: torch.Tensor  # long [R]: experts added on this rank, ascending (its replica rows)
    phases: tuple  # (Phase, ...) in gather order
    added_pairs: int  # |P' \ P| over the whole group
    intra_pairs: int  # transfers inside a node over the whole group (one direction)
    inter_pairs: int  # transfers between nodes over the whole group (one direction)

    @property
    def local_E(self) -> torch.Tensor:
        """Experts this rank computes this iteration: owned, then replicas (its compute slots)."""
        return torch.cat([self.owned_E, self.replica_E])


def gather_layout(owner_E: torch.Tensor, placement_ED: torch.Tensor, rank: int, *, topology: Topology | None = None,
                  hierarchical: bool = True) -> GatherLayout:
    owner_E = owner_E.to("cpu", torch.long)
    placement_ED = placement_ED.to("cpu", torch.bool)
    E, D = placement_ED.shape
    experts = torch.arange(E)
    if not bool(placement_ED[experts, owner_E].all()):
        raise ValueError("placement_ED must contain the shard placement (every owner holds its expert)")
    added_ED = placement_ED.clone()
    added_ED[experts, owner_E] = False
    node_D = (topology.node_D() if topology is not None else torch.zeros(D, dtype=torch.long))
    if topology is None or topology.num_nodes == 1:
        hierarchical = False

    # Global transfer list: (phase, expert, source, destination).
    transfers = []
    for e, d in torch.nonzero(added_ED).tolist():
        o = int(owner_E[e])
        if not hierarchical or node_D[d] == node_D[o]:
            transfers.append((0, e, o, d))
    if hierarchical:
        for e in torch.nonzero(added_ED.any(1)).flatten().tolist():
            o = int(owner_E[e])
            holders = torch.nonzero(added_ED[e]).flatten().tolist()
            by_node = {}
            for d in holders:
                if node_D[d] != node_D[o]:
                    by_node.setdefault(int(node_D[d]), []).append(d)
            for ds in by_node.values():
                relay = ds[0]  # the lowest rank of the node's added holders
                transfers.append((0, e, o, relay))
                transfers.extend((1, e, relay, d) for d in ds[1:])

    owned_E = torch.nonzero(owner_E == rank).flatten()
    replica_E = torch.nonzero(added_ED[:, rank]).flatten()
    owned_row = {e: i for i, e in enumerate(owned_E.tolist())}
    replica_row = {e: i for i, e in enumerate(replica_E.tolist())}
    phases = []
    for p in range(2 if hierarchical else 1):
        mine = [t for t in transfers if t[0] == p]
        if p == 1 and not mine:
            break
        send = sorted((dst, e) for _, e, src, dst in mine if src == rank)
        recv = sorted((src, e) for _, e, src, dst in mine if dst == rank)
        rows_of = replica_row if p == 1 else owned_row
        phases.append(Phase(
            send_rows=torch.tensor([rows_of[e] for _, e in send], dtype=torch.long),
            send_splits=[sum(1 for d, _ in send if d == r) for r in range(D)],
            recv_rows=torch.tensor([replica_row[e] for _, e in recv], dtype=torch.long),
            recv_splits=[sum(1 for s, _ in recv if s == r) for r in range(D)],
            from_replicas=p == 1,
        ))
    intra = sum(1 for _, _, s, d in transfers if node_D[s] == node_D[d])
    return GatherLayout(owned_E=owned_E, replica_E=replica_E, phases=tuple(phases), added_pairs=len(transfers),
                        intra_pairs=intra, inter_pairs=len(transfers) - intra)

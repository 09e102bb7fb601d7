"""Bytes over each link, and the time they take, without [D, D] tables (numpy).

Legend: B groups, E experts, N ranks of a group, G ranks per node in the group (N when the group
fits in one node), n nodes of a group, K all-reduce groups, D ranks of the world, F flows.

The links of :mod:`ds_fssdp.planner.cost`: every rank has an intra-node link (``intra_bw`` each
way), every node an inter-node link (``inter_bw`` each way); a collective costs one latency plus
the bytes of its busiest link, a link's bytes being its busier direction. These functions return
the same times as the :class:`~ds_fssdp.planner.cost.CostModel` methods they mirror (tests compare
them) plus every link's bytes, and take many groups or a compact plan at once, so the cluster
simulator never builds a [D, D] or [E, D, D] table.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_fssdp.planner.cost import Hardware
from ds_fssdp.planner.inputs import GATHER_RELAY
from ds_fssdp.planner.prices import allreduce_links as prices_allreduce_links
from ds_fssdp.planner.prices import exchange_links as prices_exchange_links
from ds_fssdp.planner.prices import _fastplan, allreduce_share, gather_links, link_seconds
from ds_fssdp.planner.onecopy import distinct_fraction  # noqa: F401  (the simulators' dedup estimate)


@dataclass
class Links:
    """Bytes over each link of B groups (busier direction)."""

    rank_BN: np.ndarray  # float64 [B, N]: each rank's intra-node link
    node_Bn: np.ndarray  # float64 [B, n]: each node's inter-node link
    inter_total: float = 0.0  # bytes that cross nodes, all groups (token exchanges only)
    rows_BN: np.ndarray | None = None  # token exchanges: rows each rank computes

    def time_B(self, hw: Hardware) -> np.ndarray:
        """Seconds per group: latency + the busiest link; 0 where nothing moves."""
        return link_seconds(self.rank_BN.max(1), self.node_Bn.max(1), hw)


def sparse_collective_links(owner_E: np.ndarray, placement_BED: np.ndarray, *, ranks_per_node: int,
                            chunk_bytes: float, relay: bool = GATHER_RELAY) -> Links:
    """SparseAllGathers (or their SparseReduceScatters) of B groups' placements with the same
    owners (:func:`~ds_fssdp.planner.prices.gather_links`, as the runtime moves them unless
    ``relay``; a [E, D] placement is one group)."""
    return Links(*gather_links(owner_E, placement_BED, ranks_per_node=ranks_per_node, chunk_bytes=chunk_bytes,
                               relay=relay))


def allreduce_links(members_KD: np.ndarray, bytes_K: np.ndarray, *, ranks_per_node: int,
                    share=allreduce_share) -> Links:
    """K ring all-reduces (or, by ``share``, reduce-scatters / all-gathers) issued together over the
    world's D ranks (:func:`~ds_fssdp.planner.prices.allreduce_links`), as one group (B = 1) of D ranks."""
    rank_D, node_n = prices_allreduce_links(members_KD, bytes_K, ranks_per_node=ranks_per_node, share=share)
    return Links(rank_BN=rank_D[None], node_Bn=node_n[None])


def traffic_BNN(tokens_BED: np.ndarray, holder_BE: np.ndarray, flows_4F: np.ndarray | None = None) -> np.ndarray:
    """Rows rank d sends rank h in each group, ``[B, d, h]`` (float64; the diagonal: rows a rank
    computes for its own tokens): source d sends its ``tokens_BED[b, e, d]`` rows of expert e to the
    expert's one holder ``holder_BE[b, e]`` (experts with ``holder < 0`` are skipped: their rows
    travel as ``flows_4F``, rows (b, h, d, k): rank d sends k rows to rank h in group b, as
    :class:`~ds_fssdp.planner.plan.DispatchPlan`'s flows with the group in place of the expert)."""
    B, E, N = tokens_BED.shape
    if _fastplan is not None:  # the same sums in C
        out = np.empty((B, N, N))
        flows = np.zeros((4, 0), dtype=np.int64) if flows_4F is None else flows_4F
        _fastplan.plan_traffic(*(np.ascontiguousarray(a, dtype=np.int64) for a in (holder_BE, tokens_BED, flows)), out,
                               B, E, N, flows.shape[1], True)
        return out
    valid_BE = holder_BE >= 0
    b_BED = np.broadcast_to(np.arange(B)[:, None, None], (B, E, N))
    d_BED = np.broadcast_to(np.arange(N)[None, None, :], (B, E, N))
    h_BED = np.broadcast_to(np.where(valid_BE, holder_BE, 0)[:, :, None], (B, E, N))
    w_BED = np.where(valid_BE[:, :, None], tokens_BED, 0).astype(np.float64)
    idx = ((b_BED * N + d_BED) * N + h_BED).ravel()
    out = np.bincount(idx, weights=w_BED.ravel(), minlength=B * N * N)
    if flows_4F is not None and flows_4F.shape[1]:
        fb, fh, fd, k = flows_4F
        out += np.bincount((fb * N + fd) * N + fh, weights=k.astype(np.float64), minlength=B * N * N)
    return out.reshape(B, N, N)


def traffic_links(traffic_BNN: np.ndarray, *, ranks_per_node: int, row_bytes: float,
                  rows_BNN: np.ndarray | None = None) -> Links:
    """The links of one token exchange of B groups from a [B, d, h] table of rows sent (``traffic_BNN``, maybe fewer
    than the rows computed under one copy per destination; the links of
    :func:`~ds_fssdp.planner.prices.exchange_links`); ``rows_BNN`` (default: the same) gives the
    rows each rank computes."""
    rank_BN, node_Bn, out_Bn = prices_exchange_links(traffic_BNN, ranks_per_node=ranks_per_node, row_bytes=row_bytes)
    rows = traffic_BNN if rows_BNN is None else rows_BNN
    return Links(rank_BN=rank_BN, node_Bn=node_Bn, inter_total=float(out_Bn.sum()), rows_BN=rows.sum(1))

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
from ds_fssdp.planner.prices import gather_links, link_seconds
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


def exchange_links(tokens_BED: np.ndarray, holder_BE: np.ndarray, *, ranks_per_node: int, row_bytes: float,
                   flows_4F: np.ndarray | None = None) -> Links:
    """One token exchange of B groups (:meth:`CostModel.a2a_time`): source d sends its
    ``tokens_BED[b, e, d]`` rows of expert e to the expert's one holder ``holder_BE[b, e]``
    (experts with ``holder < 0`` are skipped: their rows travel as ``flows_4F``, rows (b, h, d, k):
    rank d sends k rows to rank h in group b, as :class:`~ds_fssdp.planner.plan.DispatchPlan`'s
    flows with the group in place of the expert). Also returns the rows each rank computes."""
    B, E, N = tokens_BED.shape
    G, n = ranks_per_node, tokens_BED.shape[2] // ranks_per_node
    valid_BE = holder_BE >= 0
    h_BE = np.where(valid_BE, holder_BE, 0)
    T_BEnG = tokens_BED.reshape(B, E, n, G).astype(np.int64)
    if not valid_BE.all():
        T_BEnG[~valid_BE] = 0
    b_BE = np.broadcast_to(np.arange(B)[:, None], (B, E))
    e_BE = np.broadcast_to(np.arange(E)[None, :], (B, E))
    hn_BE = h_BE // G
    T_BEn = T_BEnG.sum(3)
    total_BE = T_BEn.sum(2)
    in_node_BE = T_BEn[b_BE, e_BE, hn_BE]  # rows of e from the holder's node, staying ones included
    stay_BE = T_BEnG[b_BE, e_BE, hn_BE, h_BE % G]
    # What each source sends inside its node: the experts held in its node, by node of holder.
    onehot_BEn = np.zeros((B, E, n), dtype=np.int64)
    onehot_BEn[b_BE, e_BE, hn_BE] = 1
    send_same_BN = np.einsum("ben,beng->bng", onehot_BEn, T_BEnG).reshape(B, N)
    rank_idx = (b_BE * N + h_BE).ravel()
    node_idx = (b_BE * n + hn_BE).ravel()
    stay_BN = np.bincount(rank_idx, weights=stay_BE.ravel(), minlength=B * N).reshape(B, N)
    rows_BN = np.bincount(rank_idx, weights=total_BE.ravel(), minlength=B * N).reshape(B, N)
    send_intra_BN = send_same_BN - stay_BN
    send_inter_BN = T_BEnG.sum(1).reshape(B, N) - send_same_BN
    recv_intra_BN = np.bincount(rank_idx, weights=(in_node_BE - stay_BE).ravel(), minlength=B * N).reshape(B, N)
    node_in_Bn = np.bincount(node_idx, weights=(total_BE - in_node_BE).ravel(), minlength=B * n).reshape(B, n)
    node_out_Bn = send_inter_BN.reshape(B, n, G).sum(2)
    if flows_4F is not None and flows_4F.shape[1]:
        fb, fh, fd, k = flows_4F
        k = k.astype(np.float64)
        fnh, fnd = fh // G, fd // G
        same = fnh == fnd
        k_intra = np.where(same & (fh != fd), k, 0.0)
        k_inter = np.where(same, 0.0, k)
        rows_BN += np.bincount(fb * N + fh, weights=k, minlength=B * N).reshape(B, N)
        send_intra_BN = send_intra_BN + np.bincount(fb * N + fd, weights=k_intra, minlength=B * N).reshape(B, N)
        recv_intra_BN += np.bincount(fb * N + fh, weights=k_intra, minlength=B * N).reshape(B, N)
        node_out_Bn = node_out_Bn + np.bincount(fb * n + fnd, weights=k_inter, minlength=B * n).reshape(B, n)
        node_in_Bn += np.bincount(fb * n + fnh, weights=k_inter, minlength=B * n).reshape(B, n)
    return Links(rank_BN=np.maximum(send_intra_BN, recv_intra_BN) * row_bytes,
                 node_Bn=np.maximum(node_out_Bn, node_in_Bn) * row_bytes,
                 inter_total=float(node_out_Bn.sum()) * row_bytes, rows_BN=rows_BN)


def sparse_collective_links(owner_E: np.ndarray, placement_BED: np.ndarray, *, ranks_per_node: int,
                            chunk_bytes: float, relay: bool = GATHER_RELAY) -> Links:
    """SparseAllGathers (or their SparseReduceScatters) of B groups' placements with the same
    owners (:func:`~ds_fssdp.planner.prices.gather_links`, as the runtime moves them unless
    ``relay``; a [E, D] placement is one group)."""
    return Links(*gather_links(owner_E, placement_BED, ranks_per_node=ranks_per_node, chunk_bytes=chunk_bytes,
                               relay=relay))


def allreduce_links(members_KD: np.ndarray, bytes_K: np.ndarray, *, ranks_per_node: int) -> Links:
    """K ring all-reduces issued together over the world's D ranks
    (:func:`~ds_fssdp.planner.prices.allreduce_links`), as one group (B = 1) of D ranks."""
    rank_D, node_n = prices_allreduce_links(members_KD, bytes_K, ranks_per_node=ranks_per_node)
    return Links(rank_BN=rank_D[None], node_Bn=node_n[None])


def traffic_BNN(tokens_BED: np.ndarray, holder_BE: np.ndarray, flows_4F: np.ndarray | None = None) -> np.ndarray:
    """Rows rank d sends rank h in each group, ``[B, d, h]`` (float64; the diagonal: rows a rank
    computes for its own tokens), from the same inputs as :func:`exchange_links`."""
    B, E, N = tokens_BED.shape
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
    """:func:`exchange_links` from a [B, d, h] table of rows sent (``traffic_BNN``, maybe fewer
    than the rows computed under one copy per destination); ``rows_BNN`` (default: the same) gives
    the rows each rank computes."""
    B, N, _ = traffic_BNN.shape
    G = ranks_per_node
    n = N // G
    node_N = np.arange(N) // G
    same_NN = node_N[:, None] == node_N[None, :]
    off = traffic_BNN * ~np.eye(N, dtype=bool)
    intra = off * same_NN
    inter = off - intra
    rank_BN = np.maximum(intra.sum(2), intra.sum(1)) * row_bytes
    out_Bn = inter.sum(2).reshape(B, n, G).sum(2)
    in_Bn = inter.sum(1).reshape(B, n, G).sum(2)
    rows = traffic_BNN if rows_BNN is None else rows_BNN
    return Links(rank_BN=rank_BN, node_Bn=np.maximum(out_Bn, in_Bn) * row_bytes,
                 inter_total=float(out_Bn.sum()) * row_bytes, rows_BN=rows.sum(1))

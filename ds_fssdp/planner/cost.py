"""Cost model of one MoE layer (paper section 3.3): compute, token exchange, sparse collectives.

Legend: E experts, D ranks, N nodes, G ranks per node.

Times in seconds, sizes in bytes. Links: every rank has an intra-node link of ``intra_bw`` (each
direction); every node has an inter-node link (its NICs together) of ``inter_bw`` (each direction).
A transfer costs ``latency`` plus bytes over the slowest link it needs. The same model drives
calibration, the balancing dispatcher and the cluster simulator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_fssdp.topology import Topology


@dataclass(frozen=True)
class Hardware:
    """Per-rank compute and link speeds."""

    flops: float  # achievable FLOP/s of the expert GEMMs
    intra_bw: float  # bytes/s per rank inside a node, each direction
    inter_bw: float  # bytes/s per node between nodes, each direction
    latency: float = 10e-6  # s per collective phase
    hbm_bw: float = 2e12  # bytes/s of device memory (optimizer step)


@dataclass(frozen=True)
class ExpertShape:
    hidden: int
    ffn: int
    matrices: int = 2  # 2 for gelu (w_a, w_b), 3 for swiglu
    param_bytes: int = 2  # bf16

    @property
    def params(self) -> int:
        return self.matrices * self.hidden * self.ffn

    @property
    def expert_bytes(self) -> int:
        return self.params * self.param_bytes

    @property
    def row_flops(self) -> float:
        """Forward FLOPs of one routed row through one expert."""
        return 2.0 * self.params

    @property
    def token_bytes(self) -> int:
        return self.hidden * self.param_bytes


class CostModel:

    def __init__(self, hw: Hardware, shape: ExpertShape, topology: Topology):
        self.hw, self.shape, self.topology = hw, shape, topology
        self._node_D = topology.node_D()
        self._same_DD = topology.same_node_DD()

    # -- compute ---------------------------------------------------------------------------------
    def compute_time_D(self, rows_D: torch.Tensor, *, backward: bool = True) -> torch.Tensor:
        """Expert compute per rank; the backward costs twice the forward."""
        passes = 3.0 if backward else 1.0
        return rows_D.double() * (passes * self.shape.row_flops / self.hw.flops)

    # -- token all-to-all -----------------------------------------------------------------------
    def a2a_time(self, plan_EDD: torch.Tensor) -> float:
        """One token exchange (rows of H each): the slowest link decides."""
        traffic_DD = plan_EDD.sum(0).double() * self.shape.token_bytes
        traffic_DD.fill_diagonal_(0)
        return self._exchange_time(traffic_DD)

    def a2a_bytes(self, plan_EDD: torch.Tensor) -> tuple:
        """(intra-node, inter-node) token bytes of one exchange."""
        traffic_DD = plan_EDD.sum(0).double() * self.shape.token_bytes
        traffic_DD.fill_diagonal_(0)
        return float(traffic_DD[self._same_DD].sum()), float(traffic_DD[~self._same_DD].sum())

    def _exchange_time(self, traffic_DD: torch.Tensor) -> float:
        """traffic_DD[s, d]: bytes from rank s to rank d."""
        if float(traffic_DD.sum()) == 0:
            return 0.0
        intra = traffic_DD * self._same_DD
        inter = traffic_DD * ~self._same_DD
        rank_time = torch.maximum(intra.sum(1), intra.sum(0)) / self.hw.intra_bw
        N = self.topology.num_nodes
        node_out = torch.zeros(N, dtype=torch.float64).index_add_(0, self._node_D, inter.sum(1))
        node_in = torch.zeros(N, dtype=torch.float64).index_add_(0, self._node_D, inter.sum(0))
        node_time = torch.maximum(node_out, node_in) / self.hw.inter_bw
        return self.hw.latency + max(float(rank_time.max()), float(node_time.max()))

    # -- sparse collectives ---------------------------------------------------------------------
    def gather_time(self, owner_E: torch.Tensor, placement_ED: torch.Tensor) -> float:
        """SparseAllGather (and, symmetrically, SparseReduceScatter) of ``placement_ED``.

        Well routed (section 3.3): a chunk enters each node it newly reaches once over the
        inter-node link and is forwarded inside the node; every added replica costs one chunk on
        its rank's intra-node link."""
        shard_ED = torch.zeros_like(placement_ED)
        shard_ED[torch.arange(owner_E.numel()), owner_E] = True
        added_ED = placement_ED & ~shard_ED
        if not bool(added_ED.any()):
            return 0.0
        psi = float(self.shape.expert_bytes)
        N = self.topology.num_nodes
        node_has_EN = torch.zeros(owner_E.numel(), N, dtype=torch.bool)
        node_has_EN.index_put_((torch.nonzero(placement_ED)[:, 0], self._node_D[torch.nonzero(placement_ED)[:, 1]]),
                               torch.tensor(True))
        owner_node_E = self._node_D[owner_E]
        entered_EN = node_has_EN.clone()
        entered_EN[torch.arange(owner_E.numel()), owner_node_E] = False
        node_in = entered_EN.sum(0).double() * psi
        node_out = torch.bincount(owner_node_E, weights=entered_EN.sum(1).double(), minlength=N) * psi
        rank_in = added_ED.sum(0).double() * psi
        inter = float(torch.maximum(node_in, node_out).max()) / self.hw.inter_bw if N > 1 else 0.0
        intra = float(rank_in.max()) / self.hw.intra_bw
        return self.hw.latency + max(inter, intra)

    # -- one layer ------------------------------------------------------------------------------
    def layer_time(self, plan_EDD: torch.Tensor) -> float:
        """Critical path of the MoE part of one layer (forward + backward): the slowest rank's
        compute and four token exchanges (dispatch and combine, forward and backward)."""
        rows_D = plan_EDD.sum((0, 1))
        return float(self.compute_time_D(rows_D).max()) + 4 * self.a2a_time(plan_EDD)

"""Cost model of one MoE layer (paper section 3.3): compute, token exchange, sparse collectives.

Legend: E experts, D ranks, N nodes, G ranks per node.

Times in seconds, sizes in bytes. Links: every rank has an intra-node link of ``intra_bw`` (each
direction); every node has an inter-node link (its NICs together) of ``inter_bw`` (each direction).
A transfer costs ``latency`` plus bytes over the slowest link it needs. The same model drives
calibration, the balancing dispatcher and the cluster simulator.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ds_fssdp.planner.knobs import auto_overlap_degree
from ds_fssdp.planner.plan import DispatchPlan
from ds_fssdp.planner.prices import (allreduce_links, allreduce_share, exchange_links, exposed_s, gather_links,
                                     link_seconds, reduce_scatter_share)
from ds_fssdp.planner.schedule import Linear, ScheduleCosts
from ds_fssdp.topology import Topology


def exposed_transfer(gather_s: float, window_s: float, *, rematerialize: bool = False,
                     backward_window_s: float | None = None) -> float:
    """Seconds of a layer's replica transfer the attention does not hide: the gather past the
    forward window (:meth:`CostModel.overlap_window`) plus the reduce, as long, past the
    backward's (``backward_window_s``; None: twice the window); under re-materialization the
    backward gathers again before its reduce."""
    window_b = 2.0 * window_s if backward_window_s is None else backward_window_s
    return float(exposed_s(gather_s, window_s) + exposed_s((2.0 if rematerialize else 1.0) * gather_s, window_b))


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
    matrices: int = 2  # weight matrices [H, F] or [F, H]: 2 for gelu (w_a, w_b), 3 for the gated ones
    param_bytes: int = 2  # bf16
    biases: int = 0  # bias elements per expert (0 without biases; F + H for gelu, 2F + H gated)

    @property
    def params(self) -> int:
        """Elements of one expert's row (what a gather moves)."""
        return self.matrices * self.hidden * self.ffn + self.biases

    @property
    def expert_bytes(self) -> int:
        return self.params * self.param_bytes

    @property
    def row_flops(self) -> float:
        """Forward FLOPs of one routed row through one expert: its matrices (the bias adds are
        noise beside them)."""
        return 2.0 * self.matrices * self.hidden * self.ffn

    @property
    def token_bytes(self) -> int:
        return self.hidden * self.param_bytes


class CostModel:
    """One model of the hardware for every decision and every simulator; the prices are
    ``planner/prices.py``'s. ``relay``: sparse collectives are priced relayed
    (:func:`~ds_fssdp.planner.prices.gather_links`); default (the runtime's, ``planner/inputs.py``):
    each chunk leaves its owner's node once per node it enters."""

    def __init__(self, hw: Hardware, shape: ExpertShape, topology: Topology, *, relay: bool = False):
        self.hw, self.shape, self.topology, self.relay = hw, shape, topology, relay

    # -- compute ---------------------------------------------------------------------------------
    def compute_time_D(self, rows_D: torch.Tensor, *, backward: bool = True) -> torch.Tensor:
        """Expert compute per rank; the backward costs twice the forward."""
        return rows_D.double() * ((3.0 if backward else 1.0) * self.shape.row_flops / self.hw.flops)

    # -- token all-to-all -----------------------------------------------------------------------
    def a2a_time(self, plan_EDD: torch.Tensor) -> float:
        """One token exchange (rows of H each): the slowest link decides."""
        return self.transfer_time(plan_EDD.sum(0).double() * self.shape.token_bytes)

    # -- sparse collectives ---------------------------------------------------------------------
    def gather_time(self, owner_E: torch.Tensor, placement_ED: torch.Tensor) -> float:
        """SparseAllGather (and, symmetrically, SparseReduceScatter) of ``placement_ED`` as the
        runtime moves it (section 3.3: a chunk enters each node it newly reaches once over the
        inter-node link and is forwarded inside the node; every added replica costs one chunk on
        its rank's intra-node link). Relayed under ``relay``
        (:func:`~ds_fssdp.planner.prices.gather_links`)."""
        return self.sparse_collective_time(owner_E, placement_ED, relay=self.relay)

    def broadcast_time(self, owner_E: torch.Tensor, placement_ED: torch.Tensor) -> float:
        """NCCL broadcasts of whole experts from their owners to ``placement_ED`` (FasterMoE's
        shadows): pipelined rings, so a node forwards what it received (relayed)."""
        return self.sparse_collective_time(owner_E, placement_ED, relay=True)

    def sparse_collective_time(self, owner_E: torch.Tensor, placement_ED: torch.Tensor, *, relay: bool = True) -> float:
        """Seconds of :func:`~ds_fssdp.planner.prices.gather_links` over this topology's links
        (relayed unless ``relay`` is False: :meth:`gather_time` prices as the cost model does)."""
        rank_BN, node_Bn = gather_links(owner_E.to("cpu", torch.long).numpy(), placement_ED.to("cpu", torch.bool).numpy(),
                                        ranks_per_node=self.topology.ranks_per_node,
                                        chunk_bytes=float(self.shape.expert_bytes), relay=relay)
        return link_seconds(rank_BN.max(), node_Bn.max(), self.hw)

    def transfer_time(self, traffic_DD: torch.Tensor) -> float:
        """Point-to-point transfers of ``traffic_DD[s, d]`` bytes from rank s to rank d, all at once
        (expert migration, FlexMoE expansion): the slowest rank link or node link decides."""
        traffic_DD = traffic_DD.to("cpu", torch.float64).clone()
        traffic_DD.fill_diagonal_(0)
        rank_BN, node_Bn, _ = exchange_links(traffic_DD.numpy()[None], ranks_per_node=self.topology.ranks_per_node)
        return link_seconds(rank_BN.max(), node_Bn.max(), self.hw)

    def allreduce_time(self, groups_KD: torch.Tensor, bytes_K: torch.Tensor) -> float:
        """K ring all-reduces issued together; group k (bool row of ``groups_KD``) sums ``bytes_K[k]``
        bytes (:func:`~ds_fssdp.planner.prices.allreduce_links`); groups of one rank cost nothing;
        one latency for the batch (bucketed into one call)."""
        rank_D, node_n = allreduce_links(groups_KD.to("cpu", torch.bool).numpy(),
                                         bytes_K.to("cpu", torch.float64).reshape(-1).numpy(),
                                         ranks_per_node=self.topology.ranks_per_node)
        return link_seconds(rank_D.max(), node_n.max() if self.topology.num_nodes > 1 else 0.0, self.hw)

    def flow_layer_times(self, flow_XDD: torch.Tensor) -> torch.Tensor:
        """:meth:`layer_time` of X candidate plans at once, each given as its rank-to-rank flow
        ``flow_XDD[x, d, d2]`` = rows rank d sends rank d2 (``plan_EDD.sum(0)``; float64 [X])."""
        flow_XDD = flow_XDD.to("cpu", torch.float64)
        compute_X = flow_XDD.sum(1).amax(1) * (3.0 * self.shape.row_flops / self.hw.flops)
        rank_XD, node_Xn, _ = exchange_links(flow_XDD.numpy(), ranks_per_node=self.topology.ranks_per_node,
                                             row_bytes=float(self.shape.token_bytes))
        exchange_X = torch.from_numpy(np.asarray(link_seconds(rank_XD.max(1), node_Xn.max(1), self.hw)))
        return compute_X + 4.0 * exchange_X

    def overlap_window(self, overlap_degree: int) -> float:
        """Seconds of a layer's forward attention that hide its SparseAllGather: what the overlap
        degree t means, the gather of t experts, one chunk each over the slower link a gather uses
        (a node's link when there are several nodes; "auto" t is the chunks the measured link
        moves during the measured window). The backward's attention, twice as long, hides the
        reduce."""
        return overlap_degree * float(self.shape.expert_bytes) / self.binding_bandwidth

    def overlap_degree(self, seconds: float) -> int:
        """The overlap degree t that ``seconds`` of hidden (or budgeted) transfer buys: the inverse
        of :meth:`overlap_window`, and the one place t is derived from a time (the runtime's
        "auto" t from its measured window, calibration's extra experts from its latency budget)."""
        if seconds == float("inf"):
            return 2**31 - 1  # unlimited; callers cap it at E
        return auto_overlap_degree(attention_seconds=seconds, bandwidth=self.binding_bandwidth,
                                   expert_bytes=self.shape.expert_bytes)

    def schedule_costs(self) -> ScheduleCosts:
        """The linear costs of the layer's schedule (``planner/schedule.py``) this hardware implies
        (:func:`schedule_costs`)."""
        return schedule_costs(self.hw, self.shape)

    def edp_reduce_linear(self, ranks: int, *, partitioned: bool) -> Linear:
        """One slice of the expert-data-parallel gradient reduce over ``ranks`` ranks, per byte of
        the slice each rank holds: a ring all-reduce moves 2 (n - 1) / n of it, a reduce-scatter
        (partitioned state) n - 1 times its piece; over the binding link (an EDP group spans groups)."""
        n = max(1, int(ranks))
        factor = n * reduce_scatter_share(n) if partitioned else allreduce_share(n)
        return Linear(self.hw.latency, factor / self.binding_bandwidth)

    @property
    def binding_bandwidth(self) -> float:
        """Bytes/s of the slower link a gather uses (a node's link when there are several nodes)."""
        return min(self.hw.intra_bw, self.hw.inter_bw) if self.topology.num_nodes > 1 else self.hw.intra_bw

    # -- one layer ------------------------------------------------------------------------------
    def layer_price(self, plan, attention_s: float | None = None) -> tuple:
        """``(layer_time(plan), seconds that hide the layer's replica reduce)``: here None (no
        schedule to take the backward's idle link from: the caller's default);
        :class:`~ds_fssdp.planner.scheduled.ScheduledCostModel` prices both from one exchange."""
        return self.layer_time(plan), None

    def layer_time(self, plan_EDD) -> float:
        """Critical path of the MoE part of one layer (forward + backward): the slowest rank's
        compute and four token exchanges (dispatch and combine, forward and backward).
        ``plan_EDD``: the dense plan, or a compact :class:`~ds_fssdp.planner.plan.DispatchPlan`."""
        if isinstance(plan_EDD, DispatchPlan):
            return float(self.flow_layer_times(plan_EDD.traffic_DD()[None])[0])
        return float(self.compute_time_D(plan_EDD.sum((0, 1))).max()) + 4 * self.a2a_time(plan_EDD)


def schedule_costs(hw: Hardware, shape: ExpertShape, *, backward_factor: float = 2.0) -> ScheduleCosts:
    """The :class:`~ds_fssdp.planner.schedule.ScheduleCosts` of modelled hardware (the simulators'):
    an exchange is one latency plus the busiest link's bytes over its bandwidth (intra-node per
    GPU, inter-node per node: :meth:`CostModel.a2a_time`), a routed row through one expert
    ``row_flops`` over the achievable FLOP/s; the backward twice the forward's GEMM work."""
    return ScheduleCosts(a2a_intra=Linear(hw.latency, 1.0 / hw.intra_bw),
                         a2a_inter=Linear(hw.latency, 1.0 / hw.inter_bw), gemm=Linear(0.0, shape.row_flops / hw.flops), backward_factor=backward_factor)

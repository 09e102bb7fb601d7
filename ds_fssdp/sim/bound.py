"""A lower bound on the iteration time of a workload, under any policy the simulators model.

Legend: L layers, E experts, B groups, N ranks of a group, d a source rank.

Per layer and group, each direction (forward; backward with twice the GEMM work) takes at least

    max(balanced compute + latency, 2 latency + dispatch + combine of the rows that must leave a rank)

* balanced compute: the group's rows over its N ranks (no policy computes less on its slowest
  rank);
* rows that must leave rank d: its rows on experts it cannot hold. A rank holds at most its
  owned ceil(E / N) experts plus ``budget`` replicas per layer, so it keeps at most its
  (ceil(E / N) + budget) largest experts' rows; the rest cross, each token at most once per
  destination (so at least rows / k tokens), over the rank's two links together (intra-node and,
  past one node, the whole node link), one startup each way; the combine cannot end before the
  last chunk is computed and sent back (one startup after the compute);

plus each layer's attention forward and backward. The gradient all-reduce (dense over the world
and, with several groups, each EDP group's owned experts, E L / N per rank: even owners move the
least) can overlap the backward at most, never the forward: a group's bound is

    forward + max(backward, all-reduce)

(under the serial accounting and under the schedule's gaps alike). Groups run their layers
alone: the slowest group's. Per iteration, plus what every policy pays alike: the extra compute
and the optimizer step of the most loaded rank with owners balanced over all layers
(ceil(E L / N) experts). Replica gathers, re-shards, the count all-gather and planning may all be
hidden or free, so they are not in the bound: where replicas must move (many kept experts, a
slow link) the bound is loose.
"""
from __future__ import annotations

import math

import numpy as np

from ds_fssdp.sim.links import allreduce_links
from ds_fssdp.sim.setup import GRAD_BYTES, OPT_TRAFFIC_BYTES, Setup


class LowerBound:
    """Fed the world's ``tokens_LED`` step by step like a :class:`~ds_fssdp.sim.cluster.PolicyRun`;
    ``result()``: mean seconds per timed step. ``budget``: the most replicas per rank per layer
    any policy may hold; ``groups``: only the first this many groups (as the runs simulate)."""

    def __init__(self, setup: Setup, *, group_size: int, budget: int, groups: int | None = None):
        self.setup, self.N, self.budget, self.groups = setup, group_size, max(0, budget), groups
        self.total, self.counted = 0.0, 0
        self.allreduce_s = even_allreduce_s(setup, group_size)

    def step(self, s: int, tokens_LED: np.ndarray) -> None:
        if s < self.setup.load_window:
            return
        st, hw, N = self.setup, self.setup.hw, self.N
        L, E, D = tokens_LED.shape
        B = D // N if self.groups is None else min(D // N, self.groups)
        attn_f = st.attention_fwd_s
        g = st.shape.row_flops / hw.flops
        keep = min(E, math.ceil(E / N) + self.budget)
        two_nodes = N > st.topology.ranks_per_node
        bw = hw.intra_bw + (hw.inter_bw if two_nodes else 0.0)
        forward_B, backward_B = np.zeros(B), np.zeros(B)
        for l in range(L):
            t_EBN = tokens_LED[l].reshape(E, D // N, N)[:, :B].astype(np.float64)
            rows_BN = t_EBN.sum(0)
            kept_BN = -np.sort(-t_EBN, axis=0)[:keep].sum(0)
            out_B = (rows_BN - kept_BN).max(1) / max(1, st.top_k) * st.shape.token_bytes
            x_B = 2.0 * out_B / bw
            lat_B = np.where(out_B > 0, 2.0 * hw.latency, 0.0)
            bal_B = rows_BN.sum(1) / N * g
            one_B = np.where(out_B > 0, hw.latency, 0.0)
            forward_B += attn_f + np.maximum(bal_B + one_B, x_B + lat_B)
            backward_B += 2.0 * attn_f + np.maximum(2.0 * bal_B + one_B, x_B + lat_B)
        owned = math.ceil(E * L / N) * st.shape.params
        tail = st.extra_compute_s + (st.dense_params + owned) * OPT_TRAFFIC_BYTES / hw.hbm_bw
        self.total += float((forward_B + np.maximum(backward_B, self.allreduce_s)).max()) + tail
        self.counted += 1

    def result(self) -> float:
        return self.total / max(1, self.counted)


def even_allreduce_s(setup: Setup, group_size: int) -> float:
    """The iteration's gradient all-reduce (:meth:`ds_fssdp.sim.cluster.PolicyRun._allreduce`'s
    collectives) with every rank of a group owning E L / N experts."""
    D, N = setup.topology.num_ranks, group_size
    members = [np.ones((1, D), dtype=bool)]
    sizes = [float(setup.dense_params * GRAD_BYTES)]
    if D // N > 1:
        members.append(np.tile(np.eye(N, dtype=bool), (1, D // N)))
        sizes.extend([setup.num_experts * setup.num_layers / N * setup.shape.params * GRAD_BYTES] * N)
    links = allreduce_links(np.concatenate(members), np.asarray(sizes), ranks_per_node=setup.topology.ranks_per_node)
    return float(links.time_B(setup.hw)[0])

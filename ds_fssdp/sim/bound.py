"""A lower bound on the iteration time of a workload, under any policy the simulators model.

Legend: L layers, E experts, B groups, N ranks of a group, G ranks per node in a group, n nodes
of a group, d a source rank, R replicas per rank, S distinct experts per node, C choices (R, S).

Per layer and group, each layer chooses c = (R, S): every rank holds at most R ephemeral
replicas (gathered every step) and every node at most S distinct experts (S <= G (own + R)).
A rank holds at most its owned ceil(E / N) experts, ``persistent`` replicas kept across steps
(FlexMoE's slots) and its R, ``own`` in all, so it keeps at most its ``own`` largest experts'
rows. Each direction's exchange + expert compute (forward; backward with twice the GEMM work)
takes at least

    max(balanced compute + latency, 2 latency + dispatch + combine of what must leave)

* balanced compute: the group's rows over its N ranks (no policy computes less on its slowest
  rank), plus the rank's work beside the exchange (its shared experts, ``Setup.side_ratio`` rows
  per token: the compute may overlap the exchange, never other compute);
* what must leave a rank: its rows on experts it does not hold, over its two links together
  (intra-node and, past one node, the whole node link); what must leave a node: its ranks' rows
  on experts none of them holds, over the node link. Each token crosses at most once per
  destination (:func:`leaving_bytes`: with the simulators' one copy per destination, a
  destination of ``own`` experts takes at most the share of them of a source's rows);
* one startup each way; the combine cannot end before the last chunk is computed and sent back
  (one startup after the compute);

plus each layer's attention forward and backward. Ephemeral replicas move every step: R put R
expert chunks on each holder's intra-node link, and a node's S less its free G (own - R) come in
over its node link (:func:`~ds_fssdp.sim.links.sparse_collective_links`), one latency + the
busier. The simulators charge layer l's gather g_l beyond its window, and the window is l's
attention forward plus layer l - 1's forward exchange + compute m_{l-1} less the time u_{l-1} its
exchange holds the link the gather uses (``overlap_window`` of the idle time: the node link past
one node, else the rank's), at least 2 latencies + twice the bytes that must leave over it;
calibration's gathers and FasterMoE's shadow broadcasts are charged whole. So the forward is at
least

    sum_l max(attention + m_{l-1}, g_l + u_{l-1}) + m_{L-1}          (m_{-1} = u_{-1} = 0)

Every expert a node holds beyond its owned G ceil(E / N) is held by its owner elsewhere too, so its
gradient crosses that node's link in the backward: an ephemeral replica's reduce (the simulators
charge it past the attention backward plus the time the layer's backward leaves the link free),
a persistent slot's all-reduce (a ring moves at least the expert's bytes through every node it
spans; the paper engine charges it whole), a shadow's reduce (charged whole). The same holds for
R replicas on a rank's own link. Past the most replicas a policy holds without re-materializing
them (``plain``; FSSDP's m), only ``fssdp-rm``, which gathers them again for the backward, and
FasterMoE, whose shadows' broadcast and reduce are charged whole, hold them: the reduce is charged
twice there. So a layer's backward b_l (attention backward, exchange and
expert compute) is at least max(b_l, r_l + u_l), r_l that reduce (latency + the busier link,
like g_l but beyond the owned experts alone: persistent slots save the gather, not the reduce)
and u_l the backward exchange on its link, the forward's bytes.

The gradient all-reduce (dense over the world and, with several groups, each EDP group's owned
experts, E L / N per rank: even owners move the least) can overlap the backward at most, never
the forward: a group's bound is the least over c_1..c_L of

    forward + max(backward, all-reduce) >= forward + v backward + (1 - v) all-reduce

for every v in [0, 1]. For a given v the least over c_1..c_L is a shortest path over the layers
(:func:`chain_bound`: the pair terms couple only consecutive layers); the bound is the best over
a grid of v with 0 and 1. Groups run their layers alone: the slowest group's. Per iteration, plus
what every policy pays alike: the extra compute and the optimizer step of the most loaded rank
with owners balanced over all layers (ceil(E L / N) experts). Re-shards, the count all-gather and
planning may all be hidden or free, so they are not in the bound.
"""
from __future__ import annotations

import math

import numpy as np

from ds_fssdp.sim.links import allreduce_links
from ds_fssdp.sim.setup import GRAD_BYTES, OPT_TRAFFIC_BYTES, Setup

WEIGHTS = np.linspace(0.0, 1.0, 11)  # the v grid of the backward / all-reduce relaxation


class LowerBound:
    """Fed the world's ``tokens_LED`` step by step like a :class:`~ds_fssdp.sim.cluster.PolicyRun`;
    ``result()``: mean seconds per timed step. ``budget``: the most ephemeral replicas per rank
    per layer any policy may hold (gathered every step); ``persistent``: the most replicas per
    rank per layer any policy keeps across steps (FlexMoE's slots; not gathered per step); ``plain``:
    the most ephemeral replicas per rank a policy holds whose reduce runs once (more are
    re-materialized or broadcast: the reduce is charged twice; None: ``budget``);
    ``groups``: only the first this many groups (as the runs simulate)."""

    def __init__(self, setup: Setup, *, group_size: int, budget: int, groups: int | None = None,
                 persistent: int = 0, plain: int | None = None):
        self.setup, self.N, self.budget, self.groups = setup, group_size, max(0, budget), groups
        self.persistent = max(0, persistent)
        self.plain = self.budget if plain is None else max(0, plain)
        self.total, self.counted = 0.0, 0
        self.allreduce_s = even_allreduce_s(setup, group_size)

    def step(self, s: int, tokens_LED: np.ndarray) -> None:
        if s < self.setup.load_window:
            return
        st, hw, N = self.setup, self.setup.hw, self.N
        L, E, D = tokens_LED.shape
        B = D // N if self.groups is None else min(D // N, self.groups)
        G = min(N, st.topology.ranks_per_node)
        n = N // G
        attn_f, lat = st.attention_fwd_s, hw.latency
        g = st.shape.row_flops / hw.flops
        side = st.side_ratio * st.tokens_per_gpu * g  # a rank's shared experts, forward
        psi, tb, k = float(st.shape.expert_bytes), float(st.shape.token_bytes), max(1, st.top_k)
        own = math.ceil(E / N)  # experts a rank owns
        base = own + self.persistent  # experts a rank holds without a gather
        R = np.arange(min(self.budget, E) + 1)
        keep_R = np.minimum(E, base + R)
        # A node's distinct experts: from its owned ones (fewer than its free ones: nothing gathered,
        # nothing reduced) to its free ones and up to G R gathered (one node: none).
        S = np.arange(min(E, G * own), min(E, G * (base + R[-1])) + 1) if n > 1 else np.zeros(1, dtype=np.int64)
        fits_RS = (S[None, :] <= np.minimum(E, G * keep_R)[:, None]) if n > 1 else np.ones((R.size, 1), dtype=bool)
        bw = hw.intra_bw + (hw.inter_bw if n > 1 else 0.0)
        rank_R = np.where(R > 0, lat + R * psi / hw.intra_bw, 0.0)  # R chunks on a holder's link

        def node_S(held):  # what enters a node's link beyond ``held`` experts per rank
            return np.where(S > G * held, lat + (S - G * held) * psi / hw.inter_bw, 0.0)
        gather_RS = np.maximum(rank_R[:, None], node_S(base)[None, :])
        reduce_RS = np.maximum(rank_R[:, None], node_S(own)[None, :])
        reduce_RS = reduce_RS * np.where(R > self.plain, 2.0, 1.0)[:, None]  # re-materialized: gathered again
        forward_LRSB = np.zeros((L, R.size, S.size, B))
        backward_LRSB = np.zeros((L, R.size, S.size, B))
        busy_LRSB = np.zeros((L, R.size, S.size, B))
        for l in range(L):
            t_EBN = tokens_LED[l].reshape(E, D // N, N)[:, :B].astype(np.float64)
            rows_BN = t_EBN.sum(0)
            top_KBN = top_rows(t_EBN)
            rows_1BN = rows_BN[None]
            share_RBN = np.divide(top_KBN[keep_R], rows_1BN, out=np.zeros((R.size, B, N)), where=rows_1BN > 0)
            out_RB = leaving_bytes(rows_1BN, top_KBN[keep_R], k, tb, share=share_RBN).max(2)  # what a rank sends
            x_RB = np.where(out_RB > 0, 2.0 * lat + 2.0 * out_RB / bw, 0.0)
            one_RB = np.where(out_RB > 0, lat, 0.0)
            if n > 1:  # what must leave a node over its link: rows on experts the node does not hold
                t_EBn = t_EBN.reshape(E, B, n, G).sum(3)
                # per rank, by the node's s experts, with destinations of keep_R experts each
                common_SB = leaving_bytes(t_EBn.sum(0)[None], top_rows(t_EBn)[S], k, tb).max(2)
                ranks_RSBN = leaving_bytes(rows_1BN[None], top_KBN[S][None], k, tb, share=share_RBN[:, None])
                cross_RSB = np.maximum(common_SB[None], ranks_RSBN.reshape(R.size, S.size, B, n, G).sum(4).max(3))
                x_RSB = np.where(cross_RSB > 0, 2.0 * lat + 2.0 * cross_RSB / hw.inter_bw, 0.0)
                busy_LRSB[l] = x_RSB  # the node link: the gathers' link past one node
            else:
                x_RSB = np.zeros((R.size, 1, B))
                busy_LRSB[l] = np.where(out_RB > 0, 2.0 * lat + 2.0 * out_RB / hw.intra_bw, 0.0)[:, None]
            x_RSB = np.maximum(x_RB[:, None], x_RSB)
            bal_B = rows_BN.sum(1) / N * g + side
            forward_LRSB[l] = np.maximum(bal_B + one_RB[:, None], x_RSB)
            backward_LRSB[l] = np.maximum(2.0 * attn_f + np.maximum(2.0 * bal_B + one_RB[:, None], x_RSB),
                                          reduce_RS[:, :, None] + busy_LRSB[l])
        owned = math.ceil(E * L / N) * st.shape.params
        tail = st.extra_compute_s + (st.dense_params + owned) * OPT_TRAFFIC_BYTES / hw.hbm_bw
        m_LCB, b_LCB, g_C = forward_LRSB[:, fits_RS], backward_LRSB[:, fits_RS], gather_RS[fits_RS]
        u_LCB = busy_LRSB[:, fits_RS]
        low_B = np.array([max(chain_bound(m_LCB[:, :, b], b_LCB[:, :, b], g_C, attn_f, v, self.allreduce_s,
                                          u_LCB[:, :, b])
                              for v in WEIGHTS) for b in range(B)])
        self.total += float(low_B.max()) + tail
        self.counted += 1

    def result(self) -> float:
        return self.total / max(1, self.counted)


def leaving_bytes(rows: np.ndarray, kept: np.ndarray, k: int, token_bytes: float, *,
                  share: np.ndarray | None = None) -> np.ndarray:
    """The least bytes a source sends for its ``rows`` of which at most ``kept`` stay.

    Each token crosses at most once per destination, so at least (rows - kept) / k tokens cross
    (``share`` None: a node's ranks together). For one rank, whose rows to any one destination
    are at most ``share`` of its rows (a destination holds few experts), the simulators' one copy
    per destination (:func:`~ds_fssdp.sim.links.distinct_fraction`: r_h rows to destination h
    send r_h (1 - (1 - p_h)^k) / (k p_h) with p_h = r_h / rows) sends rows / k times the sum over
    h of phi(p_h), phi(p) = 1 - (1 - p)^k. The p_h sum to q, the share that leaves, each at most
    ``share``; phi is concave with phi(0) = 0, so the sum is least with as many p_h at ``share``
    as fit and one remainder: floor(q / share) phi(share) + phi(rest) (>= phi(q) >= q; and no
    more than k q: a policy without dedup sends q rows)."""
    out = np.maximum(0.0, rows - kept)
    if share is None:
        return out / k * token_bytes
    q = np.divide(out, rows, out=np.zeros_like(out), where=rows > 0)
    q, p = np.broadcast_arrays(q, share)
    full = np.floor(np.divide(q, p, out=np.zeros_like(q), where=p > 0) + 1e-12)
    rest = np.maximum(0.0, q - full * p)
    phi = lambda x: 1.0 - (1.0 - x) ** k  # noqa: E731
    return rows * (full * phi(p) + phi(rest)) / k * token_bytes


def top_rows(t_E__: np.ndarray) -> np.ndarray:
    """Rows on the k largest experts for k = 0..E, per column: float64 [E + 1, ...]."""
    top = np.cumsum(-np.sort(-t_E__, axis=0), axis=0)
    return np.concatenate([np.zeros((1, ) + t_E__.shape[1:]), top])


def chain_bound(m_LC: np.ndarray, b_LC: np.ndarray, g_C: np.ndarray, attention_s: float, v: float,
                allreduce_s: float, busy_LC: np.ndarray | None = None) -> float:
    """The least over one choice per layer (of C) of sum_l max(attention + m_{l-1}, g_l + u_{l-1})
    + m_{L-1} + v sum_l b_l + (1 - v) all-reduce (the module docstring; ``m_LC`` a layer's forward
    exchange + compute, ``b_LC`` its backward with attention, ``g_C`` a choice's gather, ``busy_LC``
    u: the seconds the layer's forward exchange holds the link the next gather uses, at most m;
    None: 0): a shortest path over the layers. The pair term is u + max(a, g) with
    a = attention + m - u; with the previous layer's choices sorted by a, a choice of gather g
    costs min(least V' with a <= g, plus g; least V' + a with a > g), V' = V + u."""
    L = m_LC.shape[0]
    busy_LC = np.zeros_like(m_LC) if busy_LC is None else busy_LC
    value_C = np.maximum(attention_s, g_C) + v * b_LC[0]  # layer 0: its window is its attention alone
    for l in range(1, L):
        a_C = attention_s + m_LC[l - 1] - busy_LC[l - 1]
        value_C = value_C + busy_LC[l - 1]
        order = np.argsort(a_C, kind="stable")
        a_sorted, v_sorted = a_C[order], value_C[order]
        below = np.minimum.accumulate(v_sorted)  # least V among the i + 1 smallest a
        above = np.minimum.accumulate((v_sorted + a_sorted)[::-1])[::-1]  # least V + a from i on
        i = np.searchsorted(a_sorted, g_C, side="right")  # previous choices with a <= g
        with_g = np.where(i > 0, below[np.maximum(i - 1, 0)] + g_C, np.inf)
        with_a = np.where(i < a_C.size, above[np.minimum(i, a_C.size - 1)], np.inf)
        value_C = np.minimum(with_g, with_a) + v * b_LC[l]
    return float((value_C + m_LC[L - 1]).min()) + (1.0 - v) * allreduce_s


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

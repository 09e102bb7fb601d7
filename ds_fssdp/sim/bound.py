"""A lower bound on the iteration time of a workload, under any policy the simulators model.

Legend: L layers, E experts, B groups, N ranks of a group, G ranks per node in a group, n nodes
of a group, d a source rank, R replicas per rank, S distinct experts per node, K states (a
rank's R and slots, S), C choices (a state and a node's slot experts P).

Per layer and group, each layer chooses c (:class:`Choices`): every rank holds at most R
ephemeral replicas (gathered every step) and uses at most p of its ``persistent`` slots (FlexMoE's,
kept across steps), so it holds at most h = ceil(E / N) + p + R experts and keeps at most its
h largest experts' rows; every node holds at most S distinct experts (S <= G h), P of those
beyond its owned G ceil(E / N) through slots. Past one node a rank may use all its slots and the
node's P is the choice; on one node P is 0 and p is the choice. Each direction's exchange
+ expert compute (forward; backward with twice the GEMM work)
takes at least

    max(balanced compute + latency, 2 latency + dispatch + combine of what must leave)

* balanced compute: the group's rows over its N ranks (no policy computes less on its slowest
  rank), plus the rank's work beside the exchange (its shared experts, ``Setup.side_ratio`` rows
  per token: the compute may overlap the exchange, never other compute);
* what must leave a rank: its rows on experts it does not hold, over its two links together
  (intra-node and, past one node, the whole node link); what must leave a node: its ranks' rows
  on experts none of them holds, over the node link. Each token crosses at most once per
  destination (:func:`leaving_bytes`: with the simulators' one copy per destination, a
  destination of h experts takes at most the share of them of a source's rows);
* one startup each way; the combine cannot end before the last chunk is computed and sent back
  (one startup after the compute);

plus each layer's attention forward and backward. Ephemeral replicas move every step: R put R
expert chunks on each holder's intra-node link, and a node's S less its owned G ceil(E / N) and
its P slots' experts come in over its node link
(:func:`~ds_fssdp.sim.links.sparse_collective_links`), one latency + the busier. The simulators
charge layer l's gather g_l beyond its window, and the window is l's attention forward plus layer
l - 1's forward exchange + compute m_{l-1} less the time u_{l-1} its exchange holds the link the
gather uses (``overlap_window`` of the idle time: the node link past one node, else the rank's), at
least 2 latencies + twice the bytes that must leave over it;
calibration's gathers and FasterMoE's shadow broadcasts are charged whole. So the forward is at
least

    sum_l max(attention + m_{l-1}, g_l + u_{l-1}) + m_{L-1}          (m_{-1} = u_{-1} = 0)

Every expert a node holds beyond its owned G ceil(E / N) is held by its owner elsewhere too, so its
gradient crosses that node's link. An ephemeral replica's reduce runs in the backward (the
simulators charge it past the attention backward plus the time the layer's backward leaves the
link free), a shadow's is charged whole; the same holds for R replicas on a rank's own link. Past
the most replicas a policy holds without re-materializing them (``plain``; FSSDP's m), only
``fssdp-rm``, which gathers them again for the backward, and FasterMoE, whose shadows' broadcast
and reduce are charged whole, hold them: the reduce is charged twice there. So a layer's
backward b_l (attention backward, exchange and expert compute) is at least max(b_l, r_l + u_l),
r_l that reduce (latency + the busier link, like g_l) and u_l the backward exchange on its link,
the forward's bytes. A slot's gradient is all-reduced over its expert's holders after the backward
(the engine issues FlexMoE's rings there, its only policy with slots,
:meth:`~ds_fssdp.planner.cost.CostModel.allreduce_time`): a ring of k >= 2 members puts 2 (k - 1) /
k >= 1 expert's bytes on each member's link and on the node link of every node it spans, so the
layer adds x_l = latency + P experts over the node link (one node: p over a rank's link) after the
backward, whenever it uses a slot.

The gradient all-reduce (dense over the world and, with several groups, each EDP group's owned
experts, E L / N per rank: even owners move the least) can overlap the backward at most, never
the forward: a group's bound is the least over c_1..c_L of

    forward + sum_l x_l + max(backward, all-reduce) >= forward + sum_l x_l + v backward + (1 - v) all-reduce

for every v in [0, 1]. For a given v the least over c_1..c_L is a shortest path over the layers
(:func:`chain_bound`: the pair terms couple only consecutive layers); the bound is the best over
a grid of v with 0 and 1. Groups run their layers alone: the slowest group's. Per iteration, plus
what every policy pays alike: the extra compute and the optimizer step of the most loaded rank
with owners balanced over all layers (ceil(E L / N) experts; under ZeRO 1 its slices,
:func:`~ds_fssdp.sim.memory.optimizer_params`). Re-shards, the count all-gather and planning may
all be hidden or free, so they are not in the bound.

Under ZeRO 1 (:mod:`.sync`) what must land before the step is the reduce-scatter (the all-reduce
above), the dense parameters' all-gather runs at the step under every policy modelled
(DeepSpeed's), and the experts' all-gather A (several groups) runs after the optimizer step and
before each layer's first use in the next forward, so it can overlap that forward at most:

    max(forward, A) + sum_l x_l + max(backward, reduce-scatter) >= u forward + (1 - u) A + ...

for every u in [0, 1] too; :func:`chain_bound` weighs the forward's terms by u, and the bound is
the best over the (u, v) grid. At ZeRO 0 a policy either all-reduces before the step or (FSSDP
with the gaps) splits its experts' all-reduce the same way (:mod:`.sync`; every policy's, DeepSpeed's
MoE's too, in the communication dtype, ``Setup.grad_sync_bytes``): the bound is the least of these.
"""
from __future__ import annotations

import math

import numpy as np

from ds_fssdp.sim.memory import optimizer_params
from ds_fssdp.sim.setup import OPT_TRAFFIC_BYTES, Setup
from ds_fssdp.sim.sync import sync_times

try:  # chain_bound's loop in C (the same numbers), None where not built
    from ds_fssdp.sim import _fastbound
except ImportError:
    _fastbound = None

WEIGHTS = np.linspace(0.0, 1.0, 11)  # the v (and, under ZeRO 1, u) grid of the max relaxations


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
        # Each way a policy may sync (sim/sync.py, even owners): at ZeRO 0 the all-reduce before the
        # step, or (FSSDP with the gaps) its experts' part split around the step; at ZeRO 1 split.
        # With an experts' gather beside the forward, the (u, v) grid; else v alone.
        kinds = (False, True) if setup.zero_stage == 0 and setup.topology.num_ranks // group_size > 1 else (False, )
        self.syncs = [sync_times(setup, group_size, split_experts=split) for split in kinds]
        self.us = [WEIGHTS if sync.forward_gather_s > 0 else np.ones(1) for sync in self.syncs]  # v: all of WEIGHTS
        # every sync's u at once (chain_values runs each u once), and where each sync's are in it
        self.u_U = np.unique(np.concatenate(self.us))
        self.at = [np.searchsorted(self.u_U, u_X) for u_X in self.us]

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
        ch = Choices(E=E, G=G, n=n, own=own, budget=self.budget, persistent=self.persistent)
        R_A, keep_A, S, P_C, state_C = ch.R_A, ch.keep_A, ch.S, ch.P_C, ch.state_C
        A = R_A.size
        bw = hw.intra_bw + (hw.inter_bw if n > 1 else 0.0)
        rank_A = np.where(R_A > 0, lat + R_A * psi / hw.intra_bw, 0.0)  # R chunks on a holder's link
        a_C, s_C = ch.a_K[state_C], ch.s_K[state_C]
        # what enters (gathers) and leaves (reduces) a node's link: its distinct experts beyond its
        # owned ones and its slots' experts
        Q_C = S[s_C] - G * own - P_C if n > 1 else np.zeros(P_C.size, dtype=np.int64)
        node_C = np.where(Q_C > 0, lat + Q_C * psi / hw.inter_bw, 0.0)
        gather_C = np.maximum(rank_A[a_C], node_C)
        reduce_C = gather_C * np.where(R_A[a_C] > self.plain, 2.0, 1.0)  # re-materialized: gathered again
        # the slots' ring all-reduce after the backward: P experts through the node link, p through a rank's
        synced_C = P_C * psi / hw.inter_bw if n > 1 else ch.p_A[a_C] * psi / hw.intra_bw
        exposed_C = np.where(synced_C > 0, lat + synced_C, 0.0)
        # Only the states a node can hold (fits) are ever used: each layer is priced on them alone.
        a_K, s_K = ch.a_K, ch.s_K
        K = a_K.size
        m_LKB = np.zeros((L, K, B))
        c_LKB = np.zeros((L, K, B))  # the backward's attention, exchange and compute
        u_LKB = np.zeros((L, K, B))
        # every layer's top_rows, in turn, and their sorted copy (the larger's size serves both)
        top_KBN, top_SBn, scratch = np.empty((E + 1, B, N)), np.empty((E + 1, B, n)), np.empty(E * B * N)
        for l in range(L):
            t_EBN = tokens_LED[l].reshape(E, D // N, N)[:, :B].astype(np.float64)
            rows_BN = t_EBN.sum(0)
            top_rows(t_EBN, out=top_KBN, scratch=scratch)
            rows_1BN = rows_BN[None]
            share_ABN = np.divide(top_KBN[keep_A], rows_1BN, out=np.zeros((A, B, N)), where=rows_1BN > 0)
            out_AB = leaving_bytes(rows_1BN, top_KBN[keep_A], k, tb, share=share_ABN).max(2)  # what a rank sends
            x_AB = np.where(out_AB > 0, 2.0 * lat + 2.0 * out_AB / bw, 0.0)
            one_AB = np.where(out_AB > 0, lat, 0.0)
            if n > 1:  # what must leave a node over its link: rows on experts the node does not hold
                t_EBn = t_EBN.reshape(E, B, n, G).sum(3)
                # per rank, by the node's s experts, with destinations of keep_A experts each
                top_rows(t_EBn, out=top_SBn, scratch=scratch)
                common_SB = leaving_bytes(t_EBn.sum(0)[None], top_SBn[S], k, tb).max(2)
                ranks_KBN = leaving_bytes(rows_1BN, top_KBN[S[s_K]], k, tb, share=share_ABN[a_K],
                                          phi_share=phi_power(share_ABN, k)[a_K])
                cross_KB = np.maximum(common_SB[s_K], ranks_KBN.reshape(K, B, n, G).sum(3).max(2))
                x_KB = np.where(cross_KB > 0, 2.0 * lat + 2.0 * cross_KB / hw.inter_bw, 0.0)
                u_LKB[l] = x_KB  # the node link: the gathers' link past one node
            else:
                x_KB = np.zeros((K, B))
                u_LKB[l] = np.where(out_AB > 0, 2.0 * lat + 2.0 * out_AB / hw.intra_bw, 0.0)[a_K]
            x_KB = np.maximum(x_AB[a_K], x_KB)
            bal_B = rows_BN.sum(1) / N * g + side
            m_LKB[l] = np.maximum(bal_B + one_AB[a_K], x_KB)
            c_LKB[l] = 2.0 * attn_f + np.maximum(2.0 * bal_B + one_AB[a_K], x_KB)
        owned = math.ceil(E * L / N) * st.shape.params
        tail = st.extra_compute_s + optimizer_params(st, owned, N) * OPT_TRAFFIC_BYTES / hw.hbm_bw
        b_LCB = np.maximum(c_LKB[:, state_C], reduce_C[None, :, None] + u_LKB[:, state_C])

        # every way to sync at every u: the path's values are the same for every sync (only the
        # all-reduce term differs), so each u runs once for all groups
        least_UBV = chain_values(m_LKB, b_LCB, gather_C, attn_f, WEIGHTS, u_LKB, self.u_U, state_C=state_C,
                                 exposed_C=exposed_C)
        low_SB = []
        for sync, u_X, at in zip(self.syncs, self.us, self.at):  # one way to sync's best relaxation: max over u, v
            forward_X11 = ((1.0 - u_X) * sync.forward_gather_s)[:, None, None]
            at_XBV = least_UBV[at] + (1.0 - WEIGHTS) * sync.reduce_s + forward_X11
            low_SB.append(sync.step_gather_s + at_XBV.max(2).max(0))
        low_B = np.min(low_SB, axis=0)
        self.total += float(low_B.max()) + tail
        self.counted += 1

    def result(self) -> float:
        return self.total / max(1, self.counted)


class Choices:
    """One layer's choices for a group (the module docstring's c, with FlexMoE's slots).

    A rank's choice a: ``R_A`` ephemeral replicas and ``p_A`` slots in use, holding at most
    ``keep_A`` = ``own`` + p + R experts. Past one node a rank may use all of its slots (``p_A`` =
    ``persistent``) and the node's choice carries what they cost: ``S`` its distinct experts (the
    busiest node's) and ``P_C`` of them synced through its slots, not gathered (the slots' ring
    all-reduce after the backward puts each of them through the node link). On one node ``P_C`` is
    0 and a rank's p slots are synced over its own link. ``fits_AS``: the states (a, S) a node of G
    ranks can hold (``a_K``, ``s_K``: state k's); choice c is state ``state_C[c]`` (sorted, every
    state present) with ``P_C[c]`` slot experts, from the fewest that leave no more than G R experts
    to gather to the most that still replace a gather (more cost more and save nothing)."""

    def __init__(self, *, E: int, G: int, n: int, own: int, budget: int, persistent: int):
        R = np.arange(min(budget, E) + 1)
        if n == 1 and persistent:
            R_A, p_A = (x.ravel() for x in np.meshgrid(R, np.arange(min(persistent, E) + 1), indexing="ij"))
        else:
            R_A, p_A = R, np.full(R.size, persistent)
        self.R_A, self.p_A = R_A, p_A
        self.keep_A = np.minimum(E, own + p_A + R_A)
        # A node's distinct experts: from its owned ones (fewer than its free ones: nothing gathered,
        # nothing reduced) to all it may hold (one node: none).
        top = G * (own + persistent + R[-1])
        self.S = np.arange(min(E, G * own), min(E, top) + 1) if n > 1 else np.zeros(1, dtype=np.int64)
        if n > 1:
            self.fits_AS = self.S[None, :] <= np.minimum(E, G * self.keep_A)[:, None]
        else:
            self.fits_AS = np.ones((R_A.size, 1), dtype=bool)
        self.a_K, self.s_K = a_K, s_K = self.fits_AS.nonzero()
        if n > 1:
            beyond_K = self.S[s_K] - G * own  # distinct experts beyond the node's owned ones
            lo_K = np.maximum(0, beyond_K - G * R_A[a_K])
            hi_K = np.minimum(G * persistent, np.maximum(0, beyond_K))
        else:
            lo_K = hi_K = np.zeros(a_K.size, dtype=np.int64)
        count_K = hi_K - lo_K + 1
        assert (count_K >= 1).all(), "a state with no slot count (S beyond what its ranks hold)"
        self.state_C = np.repeat(np.arange(a_K.size), count_K)
        first_C = np.repeat(np.cumsum(count_K) - count_K, count_K)
        self.P_C = np.repeat(lo_K, count_K) + np.arange(self.state_C.size) - first_C


def leaving_bytes(rows: np.ndarray, kept: np.ndarray, k: int, token_bytes: float, *,
                  share: np.ndarray | None = None, phi_share: np.ndarray | None = None) -> np.ndarray:
    """The least bytes a source sends for its ``rows`` of which at most ``kept`` stay.

    Each token crosses at most once per destination, so at least (rows - kept) / k tokens cross
    (``share`` None: a node's ranks together). For one rank, whose rows to any one destination
    are at most ``share`` of its rows (a destination holds few experts), the simulators' one copy
    per destination (:func:`~ds_fssdp.sim.links.distinct_fraction`: r_h rows to destination h
    send r_h (1 - (1 - p_h)^k) / (k p_h) with p_h = r_h / rows) sends rows / k times the sum over
    h of phi(p_h), phi(p) = 1 - (1 - p)^k. The p_h sum to q, the share that leaves, each at most
    ``share``; phi is concave with phi(0) = 0, so the sum is least with as many p_h at ``share``
    as fit and one remainder: floor(q / share) phi(share) + phi(rest) (>= phi(q) >= q; and no
    more than k q: a policy without dedup sends q rows). ``phi_share``: phi(``share``) if the
    caller has it (the same numbers, computed once for shares repeated across ``kept``)."""
    out = np.maximum(0.0, rows - kept)
    if share is None:
        return out / k * token_bytes
    q = np.divide(out, rows, out=np.zeros_like(out), where=rows > 0)
    q, p = np.broadcast_arrays(q, share)
    full = np.floor(np.divide(q, p, out=np.zeros_like(q), where=p > 0) + 1e-12)
    rest = np.maximum(0.0, q - full * p)
    phi_p = phi_power(p, k) if phi_share is None else phi_share
    return rows * (full * phi_p + phi_power(rest, k)) / k * token_bytes


def phi_power(x: np.ndarray, k: int) -> np.ndarray:
    """phi(x) = 1 - (1 - x)^k of :func:`leaving_bytes`."""
    return 1.0 - (1.0 - x) ** k


def top_rows(t_E__: np.ndarray, out: np.ndarray | None = None, scratch: np.ndarray | None = None) -> np.ndarray:
    """Rows on the k largest experts for k = 0..E, per column: float64 [E + 1, ...] (into ``out``
    if given; ``scratch``: a flat float64 buffer of at least ``t_E__.size`` for the sorted copy: a
    caller's buffers reused across layers spare fresh pages)."""
    # sorted and summed along the last axis of a contiguous copy (numpy's sort and cumsum down axis
    # 0 are slow); cumsum adds in order, out[k + 1] = out[k] + the (k + 1)-th largest (counts: no -0.0)
    E, X = t_E__.shape[0], math.prod(t_E__.shape[1:])
    out = np.empty((E + 1, ) + t_E__.shape[1:]) if out is None else out
    if _fastbound is None or t_E__.dtype != np.float64:
        asc_E = np.moveaxis(t_E__, 0, -1).astype(np.float64, order="C", copy=True)  # sorted in place: a copy
        asc_E.sort(axis=-1)
        out_E = np.empty(asc_E.shape[:-1] + (E + 1, ))
        out_E[..., 0] = 0.0
        np.cumsum(asc_E[..., ::-1], axis=-1, out=out_E[..., 1:])
        out[...] = np.moveaxis(out_E, -1, 0)
        return out
    # the same in C: the copies transposed in blocks, the same additions
    asc_XE = (np.empty(X * E) if scratch is None else scratch[:X * E]).reshape(X, E)
    _fastbound.transpose(np.ascontiguousarray(t_E__), asc_XE, E, X)
    asc_XE.sort(axis=-1)
    _fastbound.running_rows(asc_XE, out, E, X)
    return out



def chain_bound(m_LK: np.ndarray, b_LC: np.ndarray, g_C: np.ndarray, attention_s: float, v: float,
                allreduce_s: float, busy_LK: np.ndarray | None = None, *, state_C: np.ndarray | None = None,
                exposed_C: np.ndarray | None = None, u: float = 1.0) -> float:
    """The least over one choice per layer (of C) of u (sum_l max(attention + m_{l-1}, g_l + u_{l-1})
    + m_{L-1}) + sum_l (v b_l + x_l) + (1 - v) all-reduce (the module docstring; ``u`` weighs the
    forward, ``allreduce_s`` what must land before the step; ``g_C`` a choice's
    gather, ``b_LC`` its backward with attention, ``exposed_C`` x: what it adds after the backward
    (None: 0); ``m_LK`` the forward exchange + compute of its state ``state_C[c]`` (None: each
    choice its own; sorted, every state present), ``busy_LK`` u: the seconds that exchange holds
    the link the next gather uses, at most m; None: 0): a shortest path over the layers, whose next
    step depends on a state only. The pair term is u + max(a, g) with a = attention + m - u; with
    the states sorted by a, a choice of gather g costs min(least V' with a <= g, plus g; least
    V' + a with a > g), V' = V + u, V a state's least value over its choices. ``v`` an array: the
    bound at each of its values (an array; the same numbers as one call each)."""
    busy_LK = np.zeros_like(m_LK) if busy_LK is None else busy_LK
    least_V = chain_values(m_LK[:, :, None], b_LC[:, :, None], g_C, attention_s, v, busy_LK[:, :, None], [u],
                           state_C=state_C, exposed_C=exposed_C)[0, 0] + (1.0 - np.reshape(v, -1)) * allreduce_s
    return float(least_V[0]) if np.ndim(v) == 0 else least_V


def chain_values(m_LKB: np.ndarray, b_LCB: np.ndarray, g_C: np.ndarray, attention_s: float, v, busy_LKB: np.ndarray,
                 u_U, *, state_C: np.ndarray | None = None, exposed_C: np.ndarray | None = None) -> np.ndarray:
    """:func:`chain_bound` of every group b (the last axis) at every forward weight u of ``u_U`` and
    every v, before its all-reduce term (1 - v) all-reduce: float64 [U, B, V]. In C where it is
    built (``_fastbound.chain``: the same operations in the same order, the same numbers)."""
    L, K, B = m_LKB.shape
    if state_C is None:
        state_C = np.arange(K)
    starts = np.flatnonzero(np.r_[True, state_C[1:] != state_C[:-1]])
    if starts.size != K:
        raise ValueError(f"state_C must be sorted with every one of the {K} states present")
    u_U, v_V = np.atleast_1d(np.asarray(u_U, dtype=np.float64)), np.reshape(v, -1).astype(np.float64)
    if _fastbound is not None:
        C = b_LCB.shape[1]
        out = np.empty((u_U.size, B, v_V.size))
        extra_C = np.zeros(C) if exposed_C is None else exposed_C
        _fastbound.chain(*(np.ascontiguousarray(a, dtype=np.float64) for a in (m_LKB, busy_LKB, b_LCB, g_C, extra_C)),
                         starts.astype(np.int64), v_V, u_U, out, L, B, float(attention_s))
        return out
    return np.array([[_chain_numpy(m_LKB[:, :, b], b_LCB[:, :, b], g_C, attention_s, v_V, busy_LKB[:, :, b], starts,
                                   0.0 if exposed_C is None else exposed_C, u) for b in range(B)] for u in u_U])


def _chain_numpy(m_LK, b_LC, g_C, attention_s, v_V, busy_LK, starts, extra_C, u) -> np.ndarray:
    """:func:`chain_values` of one group at one u, in numpy (its reference)."""
    L, K = m_LK.shape
    # the forward's terms are all linear in (attention, m, g, busy): weighing them weighs the sum
    m_LK, busy_LK, g_C, attention_s = u * m_LK, u * busy_LK, u * g_C, u * attention_s
    # every v at once (rows): the path's order of states and the gathers' places in it depend on u alone
    v_V1 = v_V[:, None]
    value_VC = np.maximum(attention_s, g_C) + v_V1 * b_LC[0] + extra_C  # layer 0: its window is its attention alone
    for l in range(1, L):
        a_K = attention_s + m_LK[l - 1] - busy_LK[l - 1]
        value_VK = np.minimum.reduceat(value_VC, starts, axis=1) + busy_LK[l - 1]
        order = np.argsort(a_K, kind="stable")
        a_sorted, v_sorted = a_K[order], value_VK[:, order]
        below = np.minimum.accumulate(v_sorted, axis=1)  # least V among the i + 1 smallest a
        above = np.minimum.accumulate((v_sorted + a_sorted)[:, ::-1], axis=1)[:, ::-1]  # least V + a from i on
        i = np.searchsorted(a_sorted, g_C, side="right")  # previous states with a <= g
        with_g = np.where(i > 0, below[:, np.maximum(i - 1, 0)] + g_C, np.inf)
        with_a = np.where(i < K, above[:, np.minimum(i, K - 1)], np.inf)
        value_VC = np.minimum(with_g, with_a) + v_V1 * b_LC[l] + extra_C
    return (np.minimum.reduceat(value_VC, starts, axis=1) + m_LK[L - 1]).min(1)

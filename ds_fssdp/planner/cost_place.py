"""Cost-aware placement ("replicate only what pays"): replicas bought with the modelled layer time.

Legend: E experts, D ranks, N nodes of G ranks.

``share[e, d]`` (float rows of expert e computed on rank d) starts at expert parallelism (the
owner computes all of its expert's predicted tokens). The modelled layer time has two parts:

* compute: ``c_row * max_d load_d`` (the slowest rank's expert rows, forward and backward);
* exchange (four token all-to-alls): rank d's link carries ``in_d`` rows in and ``out_d`` out (a
  rank's own tokens of an expert are computed there first: ``in_d = sum_e max(0, share -
  tokens)``, ``out_d = sum_e max(0, tokens - share)``) and every node link the same at node
  granularity (tokens produced in a node are computed there first); the exchange term is the mean
  link load, ``c_intra * mean_d (in_d + out_d) / 2 + c_inter * mean_n (in_n + out_n) / 2`` (a mean,
  not the busiest link: every row a move keeps off the links counts, in either direction).

Greedy, one move at a time, from the rank d* with the most rows (lowest id on ties): for every
expert e it computes rows of and every other rank r, move ``x = min(share[e, d*], (load_d* -
load_r) / 2)`` rows of e to r. If r already holds e the move is free (the balancing dispatcher
does it anyway); otherwise it adds a replica, allowed only while r has a free slot (<= m added
per rank) and e is replicated already or fewer than t experts are, and it costs that replica's
gather and reduce: ``c_same`` when r's node already holds e (the chunk is forwarded inside the
node), else ``c_cross``. A move's gain is its share of the compute drop, ``c_row * (load_d* -
max(new load_d*, new load_r)) / k`` with ``k`` the ranks above that new maximum (all k must be
relieved to lower the slowest rank that much), plus the change of the exchange term (negative
when the rows leave their node). Cover moves compete with those: for every expert e and node n
that computes fewer rows of e than it produces, move ``x = min(share[e, h], the shortfall,
load_d* - load_r)`` rows from e's busiest holder h outside n into n's least loaded holder of e, or
its least loaded rank that may take a replica (same rules); their gain is the exact change of the
slowest rank's compute plus that of the exchange term. The move with the largest gain minus cost
is taken (ties: d*'s moves first, then lowest expert, then lowest rank) while that net is more
than ``MIN_GAIN`` of the slowest rank's compute:
a replica is added only when it lowers the modelled time by more than it costs. Deterministic;
the C version (``_costplace.c``) does the same float operations in the same order, tested equal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_fssdp.planner import fast
from ds_fssdp.topology import Topology

MIN_GAIN = 0.01  # a move must lower the modelled time by 1% of the slowest rank's compute (the balancing dispatcher
# gives up to dispatch_slack, 3%, of balance for locality: finer moves buy nothing and cost iterations)


@dataclass(frozen=True)
class Coefficients:
    """Seconds: per row computed (forward + backward), per row over a rank link and over a node
    link (four exchanges), per replica gathered and reduced within a node that holds the expert /
    across nodes."""

    row: float
    intra: float
    inter: float
    same_node: float
    cross_node: float

    @classmethod
    def from_cost(cls, cost) -> "Coefficients":
        """From a :class:`~ds_fssdp.planner.cost.CostModel`. Link costs are means over the links,
        as the exchange term is: a replica's gather and reduce put its chunk twice on the owner's
        and the holder's rank links (each direction counts) and, across nodes, twice on both
        nodes' links."""
        hw, shape, topo = cost.hw, cost.shape, cost.topology
        psi, row_bytes = float(shape.expert_bytes), 4.0 * shape.token_bytes
        same = 4.0 * psi / hw.intra_bw / topo.num_ranks
        return cls(row=3.0 * shape.row_flops / hw.flops, intra=row_bytes / hw.intra_bw, inter=row_bytes / hw.inter_bw,
                   same_node=same, cross_node=same + 4.0 * psi / hw.inter_bw / topo.num_nodes)


def cost_materialize(owner_E: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *, overlap_degree: int,
                     budget: int, coefficients: Coefficients) -> torch.Tensor:
    """Return placement_ED (bool [E, D]); in C when the extension is built (same result)."""
    _check(owner_E, tokens_ED, topology, overlap_degree, budget)
    if fast.AVAILABLE:
        return fast.materialize_cost(owner_E, tokens_ED, topology, overlap_degree, budget, coefficients, MIN_GAIN)
    return cost_materialize_reference(owner_E, tokens_ED, topology, overlap_degree=overlap_degree, budget=budget,
                                      coefficients=coefficients)


def _check(owner_E, tokens_ED, topology, overlap_degree, budget) -> None:
    E = owner_E.numel()
    if tuple(tokens_ED.shape) != (E, topology.num_ranks):
        raise ValueError(f"tokens_ED {tuple(tokens_ED.shape)} does not match {E} experts on {topology.num_ranks} "
                         f"ranks")
    if overlap_degree < 0 or budget < 0:
        raise ValueError(f"overlap_degree ({overlap_degree}) and budget ({budget}) must be >= 0")


def cost_materialize_reference(owner_E: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *,
                               overlap_degree: int, budget: int, coefficients: Coefficients) -> torch.Tensor:
    """The Python specification the C version is tested against (scalar loops, same float order)."""
    _check(owner_E, tokens_ED, topology, overlap_degree, budget)
    owner = [int(o) for o in owner_E.to(torch.long).tolist()]
    T = tokens_ED.to("cpu", torch.float64).tolist()
    E, D, G = len(owner), topology.num_ranks, topology.ranks_per_node
    if any(o < 0 or o >= D for o in owner):
        raise ValueError(f"owner_E {owner} has ids outside [0, {D})")
    for e in range(E):
        for d in range(D):
            if not (T[e][d] >= 0.0) or T[e][d] == float("inf"):
                raise ValueError(f"tokens_ED[{e}, {d}] = {T[e][d]!r} must be finite and >= 0")
    c = coefficients
    N = D // G
    pos = lambda v: v if v > 0.0 else 0.0
    held = [[False] * D for _ in range(E)]
    share = [[0.0] * D for _ in range(E)]
    node_share = [[0.0] * N for _ in range(E)]  # rows of e computed in node n
    made = [[0.0] * N for _ in range(E)]  # tokens of e produced in node n
    node_has = [[False] * N for _ in range(E)]
    for e, o in enumerate(owner):
        held[e][o] = True
        node_has[e][o // G] = True
        total = 0.0
        for d in range(D):
            total += T[e][d]
            made[e][d // G] += T[e][d]
        share[e][o] = total
        node_share[e][o // G] = total
    load, rin, rout = [0.0] * D, [0.0] * D, [0.0] * D
    for d in range(D):
        for e in range(E):
            load[d] += share[e][d]
            rin[d] += pos(share[e][d] - T[e][d])
            rout[d] += pos(T[e][d] - share[e][d])
    nin, nout = [0.0] * N, [0.0] * N
    for n in range(N):
        for e in range(E):
            nin[n] += pos(node_share[e][n] - made[e][n])
            nout[n] += pos(made[e][n] - node_share[e][n])
    free = [budget] * D
    replicated = [False] * E
    distinct = 0
    t = min(overlap_degree, E)

    def after(e, ds, r, x):
        """The links' new loads if x rows of e move from ds to r: (rank ds, rank r, node a, node b)
        as (in, out) pairs; the nodes' are None when ds and r share one."""
        s, sr, Ts, Tr = share[e][ds], share[e][r], T[e][ds], T[e][r]
        s2, sr2 = s - x, sr + x
        rank_ds = (rin[ds] - pos(s - Ts) + pos(s2 - Ts), rout[ds] - pos(Ts - s) + pos(Ts - s2))
        rank_r = (rin[r] - pos(sr - Tr) + pos(sr2 - Tr), rout[r] - pos(Tr - sr) + pos(Tr - sr2))
        a, b = ds // G, r // G
        if a == b:
            return rank_ds, rank_r, None, None
        Sa, Sb, Fa, Fb = node_share[e][a], node_share[e][b], made[e][a], made[e][b]
        Sa2, Sb2 = Sa - x, Sb + x
        node_a = (nin[a] - pos(Sa - Fa) + pos(Sa2 - Fa), nout[a] - pos(Fa - Sa) + pos(Fa - Sa2))
        node_b = (nin[b] - pos(Sb - Fb) + pos(Sb2 - Fb), nout[b] - pos(Fb - Sb) + pos(Fb - Sb2))
        return rank_ds, rank_r, node_a, node_b

    for _ in range(2 * E * D + D * budget):
        ds = max(range(D), key=lambda d: (load[d], -d))
        top = load[ds]
        a = ds // G
        best = None  # (net, e, r, x, source)
        for e in range(E):
            s = share[e][ds]
            if s <= 0.0:
                continue
            for r in range(D):
                if r == ds:
                    continue
                if held[e][r]:
                    price = 0.0
                elif free[r] > 0 and (replicated[e] or distinct < t):
                    price = c.same_node if node_has[e][r // G] else c.cross_node
                else:
                    continue
                x = min(s, (top - load[r]) * 0.5)
                if x <= 0.0:
                    continue
                level = max(top - x, load[r] + x)
                k = sum(1 for d in range(D) if load[d] > level)
                if k == 0:
                    continue
                rank_ds, rank_r, node_a, node_b = after(e, ds, r, x)
                ranks = (rin[ds] + rout[ds] + rin[r] + rout[r]) - (sum(rank_ds) + sum(rank_r))
                nodes = 0.0
                if node_a is not None:
                    b = r // G
                    nodes = (nin[a] + nout[a] + nin[b] + nout[b]) - (sum(node_a) + sum(node_b))
                net = c.row * (top - level) / k + c.intra * ranks / D + c.inter * nodes / N - price
                if best is None or net > best[0]:
                    best = (net, e, r, x, ds)
        # Cover moves: rows of e a node produces but computes elsewhere, moved into it from e's
        # busiest holder outside (the exchange term), no rank past the slowest one; into the
        # node's least loaded holder of e, or its least loaded rank that can take a replica.
        order = sorted(range(D), key=lambda d: (-load[d], d))[:3]
        for e in range(E):
            h1 = h2 = -1  # e's busiest holder; its busiest holder outside h1's node
            for d in range(D):
                if share[e][d] > 0.0 and (h1 < 0 or share[e][d] > share[e][h1]):
                    h1 = d
            if h1 < 0:
                continue
            for d in range(D):
                if d // G != h1 // G and share[e][d] > 0.0 and (h2 < 0 or share[e][d] > share[e][h2]):
                    h2 = d
            can_add = replicated[e] or distinct < t
            for n in range(N):
                need = made[e][n] - node_share[e][n]
                h = h1 if h1 // G != n else h2
                if need <= 0.0 or h < 0:
                    continue
                holder = opened = -1
                for r in range(n * G, (n + 1) * G):
                    if held[e][r]:
                        if holder < 0 or load[r] < load[holder]:
                            holder = r
                    elif free[r] > 0 and can_add and (opened < 0 or load[r] < load[opened]):
                        opened = r
                for r in (holder, opened):
                    if r < 0:
                        continue
                    price = 0.0 if held[e][r] else (c.same_node if node_has[e][n] else c.cross_node)
                    x = min(share[e][h], need, top - load[r])
                    if x <= 0.0:
                        continue
                    rest = next((load[d] for d in order if d != h and d != r), 0.0)
                    level = max(rest, load[h] - x, load[r] + x)
                    rank_h, rank_r, node_h, node_r = after(e, h, r, x)
                    hn = h // G
                    ranks = (rin[h] + rout[h] + rin[r] + rout[r]) - (sum(rank_h) + sum(rank_r))
                    nodes = (nin[hn] + nout[hn] + nin[n] + nout[n]) - (sum(node_h) + sum(node_r))
                    net = c.row * (top - level) + c.intra * ranks / D + c.inter * nodes / N - price
                    if best is None or net > best[0]:
                        best = (net, e, r, x, h)
        if best is None or best[0] <= MIN_GAIN * c.row * top:
            break
        _, e, r, x, ds = best
        a = ds // G
        if not held[e][r]:
            held[e][r] = True
            node_has[e][r // G] = True
            free[r] -= 1
            if not replicated[e]:
                replicated[e] = True
                distinct += 1
        rank_ds, rank_r, node_a, node_b = after(e, ds, r, x)
        (rin[ds], rout[ds]), (rin[r], rout[r]) = rank_ds, rank_r
        if node_a is not None:
            b = r // G
            (nin[a], nout[a]), (nin[b], nout[b]) = node_a, node_b
            node_share[e][a] -= x
            node_share[e][b] += x
        load[ds] -= x
        load[r] += x
        share[e][ds] -= x
        share[e][r] += x
    return torch.tensor(held, dtype=torch.bool).reshape(E, D)

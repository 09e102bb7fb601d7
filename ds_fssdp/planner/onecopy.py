"""One copy per destination, where it pays (issue 24, item 3): the rows it saves, what it adds, the
decision, and the two-hop exchange it runs as across nodes.

Pure, like :mod:`ds_fssdp.planner.schedule`, whose layer model it prices with: the runtime
(``moe/sharded.py``), the simulator and the tests call these functions.

A token that picks several experts of one rank crosses to it once; its routing entries (K longs
per row sent: the receiver's positions) go ahead in one more all-to-all after one all-gather of
the counts, and its gate weights travel with it (as K more columns of the rows at degree 1, in
their own all-to-all each way when chunked). Where few tokens share a destination (many ranks,
top-k spread) the rows it saves can cost less than those; so "auto" takes it per layer and step
when the modelled layer is faster with it. The rows it saves come from the plan's traffic alone
(k independent picks per token: :func:`distinct_fraction`), so every rank, the simulators and a
recorded trace decide alike.

Across nodes (``topology_aware`` and several nodes of several ranks) it runs as two hops
(``moe/dispatcher.py``): :func:`relay_loads` gives that exchange's loads for the schedule,
:func:`relay_traffic` its rows per link.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ds_fssdp.planner.prices import _fastplan  # the planner's C, None where not built
from ds_fssdp.planner.schedule import (MAX_DEGREE, ScheduleCosts, _by_link, _exchange, _lin, choose_degrees,
                                      columns_of, loads_from_traffic, loads_of, pipeline_times)

INDEX_BYTES = 8  # a routing entry (long)


def distinct_fraction(traffic_DD, top_k: int) -> np.ndarray:
    """One copy per destination: the expected fraction of the rows d sends h that are distinct
    tokens, ``[..., d, h]``. From counts alone (a token's top-k picks are not in a plan or a count
    trace) it is modelled as k independent picks per token, each landing on h with d's share p of
    rows to h: a token reaches h with probability 1 - (1 - p)^k, so the distinct tokens are
    (1 - (1 - p)^k) / (k p) of the rows (1 for k = 1; 1/k when every pick lands on h). An
    approximation: top-k picks distinct experts, and real routing is correlated."""
    if top_k < 1:
        raise ValueError(f"top_k ({top_k}) must be >= 1")
    traffic = np.asarray(traffic_DD, dtype=np.float64)
    total = traffic.sum(-1, keepdims=True)
    # (masked divisions only where a zero needs them: numpy's masked loops are slow)
    p = traffic / total if total.all() else np.divide(traffic, total, out=np.zeros_like(traffic), where=total > 0)
    k = float(top_k)
    if p.all():
        return (1.0 - (1.0 - p) ** k) / (k * p)
    return np.divide(1.0 - (1.0 - p) ** k, k * p, out=np.ones_like(p), where=p > 0)


def one_copy_overhead_s(costs: ScheduleCosts, sent_DD, *, ranks_per_node: int, top_k: int, weight_bytes: float,
                        degrees: tuple) -> tuple:
    """(forward, backward) seconds per rank (float64 [D] each) one copy per destination adds to the
    layer, for ``sent_DD`` rows crossing: the count all-gather (one startup), the routing entries'
    all-to-all (K longs per row sent), and the gate weights (K values per row each way: more bytes
    on the rows' exchange at degree (1, 1), else an all-to-all of their own each way)."""
    sent = np.asarray(sent_DD, dtype=np.float64)
    D = sent.shape[0]
    _, intra, cross = _by_link(sent, ranks_per_node)
    intra_k, inter_k = intra.sum(1) * top_k, cross.sum(1) * top_k  # routing entries (rows times K)
    count = _lin(costs.a2a_intra, float(D * INDEX_BYTES))  # every rank's, the same
    entries = _exchange(costs, intra_k * INDEX_BYTES, inter_k * INDEX_BYTES)
    w_intra, w_inter = intra_k * weight_bytes, inter_k * weight_bytes
    if tuple(degrees) == (1, 1):  # riding with the rows: their bytes at the exchange's rate
        weights_fwd = weights_bwd = w_intra * costs.a2a_intra.per_unit_s + w_inter * costs.a2a_inter.per_unit_s
    else:
        weights_fwd = weights_bwd = _exchange(costs, w_intra, w_inter)
    return count + entries + weights_fwd, weights_bwd


def choose_one_copy(costs: ScheduleCosts, traffic_DD, *, ranks_per_node: int, token_bytes: float, top_k: int,
                    weight_bytes: float, degrees: tuple, relay: bool = False) -> bool:
    """Whether one copy per destination makes the layer faster at fixed ``degrees``
    (:func:`choose_exchange`'s choice with the degrees given)."""
    return choose_exchange(costs, traffic_DD, ranks_per_node=ranks_per_node, token_bytes=token_bytes, top_k=top_k,
                           weight_bytes=weight_bytes, one_copy="auto", relay=relay, degrees=degrees)[1]


def choose_exchange(costs: ScheduleCosts, traffic_DD, *, ranks_per_node: int, token_bytes: float, top_k: int,
                    weight_bytes: float, one_copy, relay: bool, degrees: tuple | None = None,
                    max_degree: int = MAX_DEGREE, side_ratio: float = 0.0) -> tuple:
    """The layer's token exchange, for every rank at once: ``((forward, backward) degrees, one copy
    per destination)``, from the plan's ``traffic_DD`` and the agreed costs (the runtime, both
    simulators and a recorded trace decide alike): :func:`price_exchange`'s choice."""
    p = price_exchange(costs, traffic_DD, ranks_per_node=ranks_per_node, token_bytes=token_bytes, top_k=top_k,
                       weight_bytes=weight_bytes, one_copy=one_copy, relay=relay, degrees=degrees,
                       max_degree=max_degree, side_ratio=side_ratio)
    return p.degrees, p.one_copy


@dataclass(frozen=True)
class ExchangePrice:
    """The exchange :func:`price_exchange` chose and what it priced it with."""
    degrees: tuple  # (forward, backward)
    one_copy: bool
    load_cols: np.ndarray  # each rank's LayerLoad as schedule.load_columns, float64 [D, 6]
    forward_R: np.ndarray  # seconds per rank, overheads included
    backward_R: np.ndarray
    sent_DD: np.ndarray | None  # rows one copy per destination sends (None: every row)
    routed: tuple | None  # its two hops' :func:`relay_traffic` (None: one hop)

    @functools.cached_property
    def loads(self) -> list:
        """One LayerLoad per rank."""
        return loads_of(self.load_cols)

    @property
    def link_load(self):
        """The first rank's LayerLoad: its links are every rank's (the group's busiest)."""
        return loads_of(self.load_cols[:1])[0]


def price_exchange(costs: ScheduleCosts, traffic_DD, *, ranks_per_node: int, token_bytes: float, top_k: int,
                   weight_bytes: float, one_copy, relay: bool, degrees: tuple | None = None,
                   max_degree: int = MAX_DEGREE, side_ratio: float = 0.0) -> ExchangePrice:
    """:func:`choose_exchange` with the loads, seconds and routed rows of the exchange chosen (what
    the simulators price the layer with).

    ``one_copy``: True, False, or "auto" (both priced; taken only where strictly faster).
    ``relay``: one copy per destination runs as two hops across nodes (``topology_aware``), priced
    by :func:`relay_loads`; else one hop with the rows :func:`distinct_fraction` estimates. For
    each candidate, each direction's degree minimises the slowest rank's
    :func:`~ds_fssdp.planner.schedule.pipeline_times` over the loads of the exchange that would run
    (``degrees`` given: those), and the candidates compare on forward + backward with
    :func:`one_copy_overhead_s`. k = 1 never takes one copy under "auto" (nothing to share).

    ``side_ratio``: the layer's work beside the exchange per token, in expert rows (the shared
    experts' FLOPs over one expert row's; :func:`side_rows`), so each rank's ``side_rows`` is its
    tokens' (its row of ``traffic_DD`` over k) times it."""
    traffic = np.asarray(traffic_DD, dtype=np.float64)
    D, G = traffic.shape[0], int(ranks_per_node)
    if one_copy == "auto":
        candidates = [False, True] if top_k > 1 else [False]
    else:
        candidates = [bool(one_copy)]
    scale = _side_scale(top_k, side_ratio)
    if (_fastplan is not None and costs.concurrent and traffic.shape == (D, D) and G >= 1 and D % G == 0
            and top_k >= 1 and max_degree >= 1 and (degrees is None or min(degrees) >= 1)):
        return _price_in_c(costs, np.ascontiguousarray(traffic), candidates, ranks_per_node=G,
                           token_bytes=token_bytes, top_k=top_k, weight_bytes=weight_bytes, relay=relay,
                           degrees=degrees, max_degree=max_degree, side_scale=scale)
    side_D = side_rows(traffic, top_k, side_ratio)
    best = None
    for c in candidates:
        over_f = over_b = 0.0
        sent = routed = None
        if c:
            sent = traffic * distinct_fraction(traffic, top_k)
            if relay:
                if G >= 2 and D % G == 0 and D // G >= 2:
                    routed = relay_traffic(traffic, ranks_per_node=G, top_k=top_k, sent_DD=sent)
                loads = relay_loads(traffic, ranks_per_node=G, token_bytes=token_bytes, top_k=top_k, sent_DD=sent,
                                    routed=routed, side_D=side_D, columns=True)
            else:
                loads = loads_from_traffic(traffic, ranks_per_node=G, token_bytes=token_bytes, sent_DD=sent,
                                           side_D=side_D, columns=True)
        else:
            loads = loads_from_traffic(traffic, ranks_per_node=G, token_bytes=token_bytes, side_D=side_D,
                                       columns=True)
        deg = tuple(degrees) if degrees is not None else choose_degrees(costs, loads, max_degree=max_degree)
        if c:
            over_f, over_b = one_copy_overhead_s(costs, sent, ranks_per_node=G, top_k=top_k,
                                                 weight_bytes=weight_bytes, degrees=deg)
        fwd = pipeline_times(costs, loads, deg[0]) + over_f
        bwd = pipeline_times(costs, loads, deg[1], backward=True) + over_b
        layer = float((fwd + bwd).max())
        if best is None or layer < best[0]:
            best = (layer, ExchangePrice((int(deg[0]), int(deg[1])), c, loads, fwd, bwd, sent, routed))
    return best[1]


def _price_in_c(costs: ScheduleCosts, traffic: np.ndarray, candidates: list, *, ranks_per_node: int,
                token_bytes: float, top_k: int, weight_bytes: float, relay: bool, degrees, max_degree: int,
                side_scale: float) -> ExchangePrice:
    """:func:`price_exchange` under concurrent costs in C (``_fastplan.exchange_price``: the same
    operations in numpy's order, so the same numbers; tests/test_onecopy_c.py), the powers of
    :func:`distinct_fraction` by numpy (its pow, SIMD where the CPU has it, is not libm's)."""
    D, G = traffic.shape[0], ranks_per_node
    n = D // G
    two_hops = relay and G >= 2 and n >= 2
    shares = powers = b""
    if True in candidates:
        shares = np.empty(D * D + (2 * D * n if two_hops else 0))
        _fastplan.exchange_shares(traffic, shares, D, G, two_hops)
        powers = (1.0 - shares[:D * D + (D * n if two_hops else 0)]) ** float(top_k)
    fixed = (0, 0) if degrees is None else (int(degrees[0]), int(degrees[1]))
    best = None
    for c in candidates:
        out = np.empty(D * D + 10 * D + n)  # exchange_price's layout: cols, forward, backward, sent, routed
        f, b, layer, crossing = _fastplan.exchange_price(
            traffic, shares, powers, costs.c_row, out, D, G, float(token_bytes), int(top_k), float(weight_bytes),
            side_scale, c, two_hops, fixed[0], fixed[1], int(max_degree))
        if best is None or layer < best[0]:
            best = (layer, c, (f, b), crossing, out)
    _, c, deg, crossing, out = best
    r = 8 * D + D * D  # where the routed rows start
    routed = (out[r:r + D], out[r + D:r + D + n], crossing, out[r + D + n:r + 2 * D + n]) if c and two_hops else None
    return ExchangePrice(deg, c, out[:6 * D].reshape(D, 6), out[6 * D:7 * D], out[7 * D:8 * D],
                         out[8 * D:r].reshape(D, D) if c else None, routed)


def _side_scale(top_k: int, side_ratio: float) -> float:
    """What :func:`side_rows` multiplies a rank's rows by (0.0: no side work)."""
    if not side_ratio:
        return 0.0
    if side_ratio < 0:
        raise ValueError(f"side_ratio ({side_ratio}) must be >= 0")
    return float(side_ratio) / max(1, int(top_k))


def side_rows(traffic_DD, top_k: int, side_ratio: float):
    """Each rank's work beside the exchange in expert rows (float64 [D], None for none): its tokens
    (its row of the plan's ``traffic_DD``, rows per assignment, over ``top_k``) times
    ``side_ratio``."""
    if not side_ratio:
        return None
    return np.asarray(traffic_DD, dtype=np.float64).sum(1) * _side_scale(top_k, side_ratio)


def relay_loads(traffic_DD, *, ranks_per_node: int, token_bytes: float, top_k: int, sent_DD=None,
                routed: tuple | None = None, side_D=None, columns: bool = False) -> list:
    """:func:`loads_from_traffic` of the two-hop exchange (module docstring) from the plan's
    ``traffic_DD`` (rows per assignment), the rows that cross estimated by :func:`distinct_fraction`
    (k independent picks; every rank, the simulators and a recorded trace estimate alike), per link
    by :func:`relay_traffic`:

    * ``relay_bytes`` (every rank's): the busiest node link's relay hop;
    * ``intra_bytes``: the busiest rank link's hop inside the node, ``inter_bytes`` 0;
    * ``local_rows``: d's own tokens on its experts (computed first); ``remote_rows`` the rest.

    One node, or one rank per node: :func:`loads_from_traffic` of the one-hop one copy. ``sent_DD``:
    ``traffic_DD`` times its :func:`distinct_fraction`, and ``routed``: its :func:`relay_traffic`,
    where the caller has them already; ``side_D``: each rank's ``side_rows`` (default none);
    ``columns``: their ``schedule.load_columns`` instead."""
    t = np.asarray(traffic_DD, dtype=np.float64)
    D, G = t.shape[0], int(ranks_per_node)
    if G < 1 or D % G:
        raise ValueError(f"relay_loads: ranks_per_node ({ranks_per_node}) must divide the ranks ({D})")
    sent = t * distinct_fraction(t, top_k) if sent_DD is None else np.asarray(sent_DD, dtype=np.float64)
    if D // G == 1 or G == 1:
        return loads_from_traffic(t, ranks_per_node=G, token_bytes=token_bytes, sent_DD=sent, side_D=side_D,
                                  columns=columns)
    if routed is None:
        routed = relay_traffic(t, ranks_per_node=G, top_k=top_k, sent_DD=sent)
    rank_D, node_n = routed[:2]
    intra, relay = float(rank_D.max()) * token_bytes, float(node_n.max()) * token_bytes
    rows_D, local = t.sum(0), np.diagonal(t)
    cols = columns_of(intra, 0.0, local, rows_D - local, side_D, relay)
    return cols if columns else loads_of(cols)


def relay_traffic(traffic_DD, *, ranks_per_node: int, top_k: int, sent_DD=None) -> tuple:
    """The rows of one copy per destination over each link as the runtime routes them across
    several nodes of several ranks (module docstring), from the plan's ``traffic_DD``:
    ``(rank_D, node_n, crossing, landed_D)``.

    The relay hop: d sends node m the distinct tokens of its rows to m (the node's share p of d's
    rows in :func:`distinct_fraction`), to the rank of m with d's local index. The hop inside the
    node: the relay (m, j) sends h of node m the distinct tokens of every source with local index j
    to h (``sent_DD``, the per-rank one copy; default ``traffic_DD`` times its
    :func:`distinct_fraction`). ``rank_D``: each rank's intra-node link (busier direction: the hop
    inside the node); ``node_n``: each node's link (busier direction: the relay hop); ``crossing``:
    rows that cross nodes; ``landed_D``: rows h computes that need no hop inside its node (its own
    tokens on its experts, and rows whose relay is h)."""
    t = np.asarray(traffic_DD, dtype=np.float64)
    D, G = t.shape[0], int(ranks_per_node)
    if G < 2 or D % G or D // G < 2:
        raise ValueError(f"relay_traffic: two hops need several nodes of several ranks: ranks_per_node "
                         f"({ranks_per_node}) >= 2 dividing the ranks ({D}) at least twice")
    sent = t * distinct_fraction(t, top_k) if sent_DD is None else np.asarray(sent_DD, dtype=np.float64)
    n = D // G
    node = np.arange(D) // G
    to_node_Dn = t.reshape(D, n, G).sum(2)
    hop_Dn = to_node_Dn * distinct_fraction(to_node_Dn, top_k)
    hop_Dn[np.arange(D), node] = 0.0  # a node's own tokens take the hop inside it alone
    node_out = hop_Dn.sum(1).reshape(n, G).sum(1)
    moved_GD = sent.reshape(n, G, D).sum(0)  # rows relay (m, j) forwards to h in m: sources of local index j, [j, h]
    moved_GD.reshape(G, n, G)[np.arange(G), :, np.arange(G)] = 0.0
    relay_out = moved_GD.reshape(G, n, G).sum(2).T.reshape(D)  # relay (m, j)
    relay_in = moved_GD.sum(0)
    landed_GD = t.reshape(n, G, D).sum(0)  # rows of sources with local index j to h
    # rows landing with the relay hop at their destination: sources of h's local index
    local = landed_GD.reshape(G, n, G)[np.arange(G), :, np.arange(G)].T.reshape(D)
    return np.maximum(relay_out, relay_in), np.maximum(node_out, hop_Dn.sum(0)), float(hop_Dn.sum()), local

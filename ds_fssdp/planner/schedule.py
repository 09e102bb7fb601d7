"""The schedule of one MoE layer (FSMoE, seed 002): the token exchange split into chunks that
pipeline with the expert compute, forward and backward each with its own degree.

Legend: n the pipeline degree (chunks per exchange).

Pure: costs and one rank's loads in, decisions and modelled seconds out. The runtime (its fitted
costs, its agreed loads), the simulator (its modelled hardware) and the report call these
functions, so a decision is made in one place.

The modelled schedule, per direction (forward, backward), on one rank:

* two resources run concurrently: the links (the exchange's intra-node and inter-node parts on
  their own streams, a chunk has landed when both parts have) and the compute stream;
* degree 1 is the unchunked layer: dispatch, the grouped GEMM over every row, combine, in
  sequence;
* degree n >= 2: the rows of experts this rank holds for its own tokens (``local_rows``) are
  computed first, while chunk 1 is in flight; the remote rows arrive in n ragged chunks; the links
  run dispatch 1, dispatch 2, combine 1, dispatch 3, combine 2, ..., combine n (a combine is sent
  as soon as its chunk is computed, after the dispatch already queued); compute runs local, then
  chunk 1..n, each when its dispatch has landed.

Work beside the exchange (``LayerLoad.side_rows``): compute that needs none of the exchange's rows,
the family's shared experts over this rank's own tokens, in units of expert rows (FLOPs over one
expert row's). At degree 1 the block runs it as written, in sequence with the layer; at degree
n >= 2 the runtime computes it once the last return is launched (``moe/side.py``): one hop, after
the last chunk's GEMM, while combine n flies; two hops, once the last hop back inside the node has
landed (the sender's last unpermute waits for it), while the last relay return flies. (Placed
there, it hides behind a transfer that nothing else can fill; before chunk 1 it would hide only
what the local rows leave of it.)

The backward is the same pipeline over the gradients with ``backward_factor`` times the GEMM
work (input and weight gradients).

Two hops (one copy per destination with several nodes of several ranks and ``topology_aware``:
``moe/dispatcher.py``): a token crosses to a node once, to the relay there with its source's local
index, which forwards it inside the node (``LayerLoad.relay_bytes``, the busiest node link's relay
hop; ``intra_bytes`` the busiest rank link's hop inside the node; ``inter_bytes`` 0;
``local_rows`` the rank's own tokens on its experts;
:func:`~ds_fssdp.planner.onecopy.relay_loads`). At degree 1 the relay hop runs before the layer's
exchange inside the node and its return after it. At degree n >= 2 both hops are chunked
(``moe/relay.py``): the local rows are computed first; each chunk j then flows through its relay
hop (node link), its hop inside the node (rank link), its GEMM, its hop back and its relay return,
each waiting for the one before; the links and the compute each run their operations in the
order the runtime issues them (:func:`relay_order`: chunk j + 1's hops are issued before chunk j
is computed).

Other traffic in the layer's span (``LayerLoad.other_*_bytes``): collectives that are not the
layer's token exchange but are in flight while a direction runs. In the runtime's schedule: during
layer l's forward, layer l+1's replica SparseAllGather (started early, right before l's exchange:
replicas on the idle link; its first, asynchronous phase). During a backward, none: l's replica
SparseReduceScatter starts only after l's backward (measured; ``moe/sharded.py``
``_other_bytes``), so the runtime records 0 there. With concurrent costs such transfers use the
link the exchange leaves idle and the schedule prices nothing for them here (their exposure is
the replicas' window, :func:`overlap_window`). Without (CPU ranks: gloo's threads move them on the
compute's cores), a direction costs its schedule plus one :meth:`ScheduleCosts.exchange` of those
bytes (:func:`other_traffic_s`): the same sum-of-parts accounting as a chunked layer there.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ds_fssdp.planner.prices import _fastplan  # the planner's C, None where not built

MAX_DEGREE = 8


@dataclass(frozen=True)
class Linear:
    """``startup_s + per_unit_s * units`` (0 for nothing to do): a collective over bytes, a grouped
    GEMM over rows."""
    startup_s: float
    per_unit_s: float

    def __call__(self, units: float) -> float:
        return 0.0 if units <= 0 else self.startup_s + self.per_unit_s * float(units)


def fit_linear(units, seconds) -> tuple:
    """Least-squares ``Linear`` through measured (units, seconds) and its relative fit error (the
    median of |predicted - measured| / measured). Startup and rate are clamped at 0."""
    x = np.asarray(units, dtype=np.float64).ravel()
    y = np.asarray(seconds, dtype=np.float64).ravel()
    if x.size != y.size or x.size < 2:
        raise ValueError(f"fit_linear needs >= 2 (units, seconds) pairs of equal length, got {x.size} and {y.size}")
    if np.ptp(x) == 0:
        fit = Linear(0.0, float(max(0.0, y.mean() / x[0]))) if x[0] > 0 else Linear(float(max(0.0, y.mean())), 0.0)
    else:
        rate, startup = np.polyfit(x, y, 1)
        if startup < 0:  # through the origin
            startup, rate = 0.0, float((x @ y) / (x @ x))
        elif rate < 0:
            startup, rate = float(y.mean()), 0.0
        fit = Linear(float(startup), float(rate))
    pred = np.array([fit(v) for v in x])
    ok = y > 0
    err = float(np.median(np.abs(pred[ok] - y[ok]) / y[ok])) if ok.any() else 0.0
    return fit, err


@dataclass(frozen=True)
class ScheduleCosts:
    """The fitted (runtime) or modelled (simulator) costs the schedule is decided from."""
    a2a_intra: Linear  # one exchange over bytes on the busiest intra-node link
    a2a_inter: Linear  # one exchange over bytes on the busiest inter-node link
    gemm: Linear  # forward grouped GEMM over rows (a row through one expert)
    backward_factor: float = 2.0  # backward GEMM work / forward's
    # Exchanges and compute run at the same time (CUDA: the collectives on their own streams). False
    # on CPU ranks: gloo's worker threads and the compute share the same cores, so a chunked layer
    # costs the sum of its parts (every chunk adds a startup) and degree 1 is always chosen.
    concurrent: bool = True

    def exchange(self, intra_bytes: float, inter_bytes: float) -> float:
        """One exchange (or one chunk of it): intra- and inter-node parts on their own streams."""
        return max(self.a2a_intra(intra_bytes), self.a2a_inter(inter_bytes))

    @functools.cached_property
    def c_row(self) -> np.ndarray:
        """The seven numbers the schedule's C takes (``_fastplan``): the three fits' startups and
        rates, then ``backward_factor``."""
        row = np.array(self.as_row()[:7], dtype=np.float64)
        row.flags.writeable = False
        return row

    def as_row(self) -> list:
        """The eight numbers a trace records per decision (:meth:`from_row` rebuilds these costs)."""
        return [self.a2a_intra.startup_s, self.a2a_intra.per_unit_s, self.a2a_inter.startup_s,
                self.a2a_inter.per_unit_s, self.gemm.startup_s, self.gemm.per_unit_s, float(self.backward_factor),
                float(self.concurrent)]

    @classmethod
    def from_row(cls, row) -> "ScheduleCosts":
        r = [float(v) for v in row]
        if len(r) != 8:
            raise ValueError(f"ScheduleCosts.from_row: 8 numbers expected, got {len(r)}")
        return cls(Linear(r[0], r[1]), Linear(r[2], r[3]), Linear(r[4], r[5]), r[6], bool(r[7]))


@dataclass(frozen=True)
class LayerLoad:
    """One rank's share of a layer's exchange and compute (the straggler's, for a decision all
    ranks share): bytes it moves over its busiest intra-node and inter-node link per exchange, the
    rows it computes for its own tokens and for other ranks' tokens."""
    intra_bytes: float
    inter_bytes: float
    local_rows: float
    remote_rows: float
    # Other collectives in flight during the forward / backward (module docstring: the next layer's
    # replica gather in the forward; nothing the runtime records in the backward), on this rank's
    # intra-node and inter-node link, units as ``intra_bytes``. Priced only when not concurrent.
    other_fwd_intra_bytes: float = 0.0
    other_fwd_inter_bytes: float = 0.0
    other_bwd_intra_bytes: float = 0.0
    other_bwd_inter_bytes: float = 0.0
    # Two hops (module docstring): the relay hop's bytes on the busiest node link in each
    # direction; 0: one hop.
    relay_bytes: float = 0.0
    # Work beside the exchange (module docstring): expert rows' worth of compute that needs no
    # exchanged row (the shared experts over the rank's tokens); 0: none.
    side_rows: float = 0.0


def pipeline_time(costs: ScheduleCosts, load: LayerLoad, degree: int, *, backward: bool = False) -> float:
    """Modelled seconds of one direction of the layer's exchange + expert compute + exchange back
    at ``degree`` (the module docstring's schedule)."""
    return float(pipeline_times(costs, [load], degree, backward=backward)[0])


def pipeline_times(costs: ScheduleCosts, loads, degree: int, *, backward: bool = False) -> np.ndarray:
    """:func:`pipeline_time` of every load at once (float64 [len(loads)]): the one implementation
    of the modelled schedule (in C, ``_fastplan.schedule_times``, under concurrent costs where it is
    built: the same operations in the same order). ``loads``: :class:`LayerLoad` s, or their
    :func:`load_columns` (no other traffic)."""
    if degree < 1:
        raise ValueError(f"pipeline degree ({degree}) must be >= 1")
    a = load_columns(loads)
    if costs.concurrent and _fastplan is not None and len(a):
        out = np.empty(len(a))
        _fastplan.schedule_times(a, costs.c_row, out, len(a), int(degree), bool(backward))
        return out
    if isinstance(loads, np.ndarray):
        loads = loads_of(a)
    relay = a[:, 5]
    if degree == 1:  # the relay hop and its return around the exchange inside the node
        return _one_hop_times(costs, loads, a[:, :5].T, 1, backward) + 2.0 * _lin(costs.a2a_inter, relay)
    two_hops = relay > 0
    if not two_hops.any():
        return _one_hop_times(costs, loads, a[:, :5].T, degree, backward)
    if two_hops.all():
        return _relay_times(costs, loads, a.T, degree, backward)
    return np.where(two_hops, _relay_times(costs, loads, a.T, degree, backward),
                    _one_hop_times(costs, loads, a[:, :5].T, degree, backward))


LOAD_COLUMNS = ("intra_bytes", "inter_bytes", "local_rows", "remote_rows", "side_rows", "relay_bytes")


def load_columns(loads) -> np.ndarray:
    """float64 [len(loads), 6]: each :class:`LayerLoad`'s :data:`LOAD_COLUMNS` (an array of them as it is)."""
    if isinstance(loads, np.ndarray):
        return np.ascontiguousarray(loads, dtype=np.float64).reshape(-1, 6)
    return np.array([(ld.intra_bytes, ld.inter_bytes, ld.local_rows, ld.remote_rows, ld.side_rows, ld.relay_bytes)
                     for ld in loads], dtype=np.float64).reshape(-1, 6)


def _relay_times(costs: ScheduleCosts, loads: list, cols, n: int, backward: bool):
    """Two hops at degree ``n`` >= 2 (module docstring, :func:`relay_order`): the local rows
    first, then per chunk j its relay hop R_j (node link), hop inside the node I_j (rank link),
    GEMM C_j, hop back I'_j and relay return R'_j, each after the one before it; every link and
    the compute run their operations in the order the runtime issues them; the side work once the
    last chunk's GEMM and hop back have ended."""
    factor = costs.backward_factor if backward else 1.0
    intra, _, local, remote, side, relay = cols
    r = _lin(costs.a2a_inter, relay / n)
    x = _lin(costs.a2a_intra, intra / n)
    g = factor * _lin(costs.gemm, remote / n)
    c0 = factor * _lin(costs.gemm, local)
    s = factor * _lin(costs.gemm, side)
    if not costs.concurrent:
        return 2.0 * n * (r + x) + n * g + c0 + s + _other_traffic(costs, loads, backward)
    # free: when each resource (0 node link, 1 rank link, 2 compute) is next free; each operation
    # starts when its resource is free and its chunk's operation before it has ended
    free = [r * 0.0, r * 0.0, c0]
    dur = (r, x, g, x, r)
    ended = [[None] * n for _ in range(5)]  # [kind][chunk]: kinds R, I, C, J, Q
    for kind, j, resource in _relay_steps(n):
        start = free[resource] if kind == 0 else _max(free[resource], ended[kind - 1][j])
        ended[kind][j] = free[resource] = start + dur[kind]
    return _max(free[0], _max(free[2], ended[3][n - 1]) + s)


_RELAY_KINDS = {"R": (0, 0), "I": (1, 1), "C": (2, 2), "J": (3, 1), "Q": (4, 0)}  # (kind, resource)


@functools.lru_cache(maxsize=64)
def _relay_steps(n: int) -> tuple:
    """:func:`relay_order` as (kind, chunk, resource): R, I, C, J, Q are kinds 0-4, the node link,
    rank link and compute resources 0-2."""
    return tuple((_RELAY_KINDS[kind][0], j, _RELAY_KINDS[kind][1]) for kind, j in relay_order(n))


def relay_order(n: int) -> list:
    """The order the runtime issues the two-hop pipeline's operations at degree n
    (``moe/relay.py``): ("R", j) relay chunk j, ("I", j) its hop inside the node, ("C", j) its
    GEMM, ("J", j) the hop back inside the node, ("Q", j) the relay return (j 0-based); the local
    rows' GEMM runs before all of them."""
    order = [("R", 0)]
    for t in range(n + 2):
        if t < n:
            if t + 1 < n:
                order.append(("R", t + 1))
            order.append(("I", t))
        if 1 <= t <= n:
            order += [("C", t - 1), ("J", t - 1)]
        if t >= 2:
            order.append(("Q", t - 2))
    return order


def _one_hop_times(costs: ScheduleCosts, loads: list, cols, degree: int, backward: bool):
    """The pipeline of :func:`pipeline_times` over one hop: ``cols`` the loads' (intra, inter,
    local, remote, side) columns (arrays, or one load's floats)."""
    factor = costs.backward_factor if backward else 1.0
    intra, inter, local, remote, side = cols

    def gemm(rows):
        return factor * _lin(costs.gemm, rows)

    if degree == 1:
        return (2.0 * _exchange(costs, intra, inter) + gemm(local + remote) + gemm(side)
                + _other_traffic(costs, loads, backward))
    n = degree
    x = _exchange(costs, intra / n, inter / n)
    g = gemm(remote / n)
    if not costs.concurrent:
        return 2.0 * n * x + gemm(side) + gemm(local) + n * g + _other_traffic(costs, loads, backward)
    return _pipeline(x, g, gemm(local), n, gemm(side))


def _pipeline(x: np.ndarray, g: np.ndarray, compute: np.ndarray, n: int, side=0.0) -> np.ndarray:
    """The concurrent schedule's end: the links run :func:`_link_order`'s n dispatch and n combine
    chunks of ``x`` seconds each, the rank its ``compute`` first, then chunk i's ``g`` seconds once
    dispatch i has landed; combine i waits for chunk i's work; the ``side`` work after the last
    chunk's, while the last combine flies."""
    link = x * 0.0
    done_d, done_g, gi = [None] * (n + 1), [None] * (n + 1), 1
    for kind, i in _link_order(n):
        if kind == "d":
            link = link + x
            done_d[i] = link
        else:
            while gi <= i:
                compute = _max(compute, done_d[gi]) + g
                done_g[gi] = compute
                gi += 1
            link = _max(link, done_g[i]) + x
    return _max(link, compute + side)


def _lin(f: Linear, units):
    if isinstance(units, float):
        return 0.0 if units <= 0 else f.startup_s + f.per_unit_s * units
    return np.where(units <= 0, 0.0, f.startup_s + f.per_unit_s * units)


def _max(a, b):
    return (a if a >= b else b) if isinstance(a, float) and isinstance(b, float) else np.maximum(a, b)


def _exchange(costs: ScheduleCosts, intra_bytes, inter_bytes):
    return _max(_lin(costs.a2a_intra, intra_bytes), _lin(costs.a2a_inter, inter_bytes))


def _other_traffic(costs: ScheduleCosts, loads: list, backward: bool):
    """:func:`other_traffic_s` of every load (float64 [len(loads)]; 0.0 with concurrent costs)."""
    if costs.concurrent:
        return 0.0
    a = np.array([(ld.other_bwd_intra_bytes, ld.other_bwd_inter_bytes) if backward else
                  (ld.other_fwd_intra_bytes, ld.other_fwd_inter_bytes) for ld in loads],
                 dtype=np.float64).reshape(-1, 2)
    return _exchange(costs, a[:, 0], a[:, 1])


def other_traffic_s(costs: ScheduleCosts, load: LayerLoad, *, backward: bool = False) -> float:
    """Seconds one direction of the layer pays for the other collectives in flight during it
    (``load.other_*_bytes``, module docstring): 0 with concurrent costs (they use the idle link),
    else one :meth:`ScheduleCosts.exchange` of their bytes. Part of :func:`pipeline_time`."""
    return 0.0 if costs.concurrent else float(_other_traffic(costs, [load], backward)[0])


def _link_order(n: int) -> list:
    return [("d", 1)] + [op for i in range(2, n + 1) for op in (("d", i), ("c", i - 1))] + [("c", n)]


def choose_degree(costs: ScheduleCosts, load: LayerLoad, *, backward: bool, max_degree: int = MAX_DEGREE) -> int:
    """The degree of one direction for one load (:func:`choose_degrees`' rule)."""
    return choose_degrees(costs, [load], max_degree=max_degree)[1 if backward else 0]


def layer_time(costs: ScheduleCosts, load: LayerLoad, degrees: tuple) -> float:
    """Forward + backward of the layer's exchange and expert compute at ``degrees`` (fwd, bwd)."""
    return pipeline_time(costs, load, degrees[0]) + pipeline_time(costs, load, degrees[1], backward=True)


def choose_degrees(costs: ScheduleCosts, loads, *, max_degree: int = MAX_DEGREE) -> tuple:
    """(forward, backward) degrees of a layer for every rank at once (the exchange is one collective,
    so all ranks must chunk it alike): each direction's degree minimises the slowest rank's
    :func:`pipeline_time` over ``loads`` (one :class:`LayerLoad` per rank, or their
    :func:`load_columns`); a degree wins only below the best so far by a relative 1e-9 (the
    smaller on a tie). In C where it is built (``_fastplan.choose_degrees``, the same numbers)."""
    if not costs.concurrent:
        # Serial parts: n chunks cost 2n exchange startups and n + 1 GEMM startups for the same
        # bytes and rows, never less than one chunk's, so degree 1 (and the loads are not needed).
        return 1, 1
    a = load_columns(loads)
    if _fastplan is not None:
        return _fastplan.choose_degrees(a, costs.c_row, len(a), int(max_degree))

    def best(backward: bool) -> int:
        pick, pick_s = 1, None
        for n in range(1, max_degree + 1):
            s = pipeline_times(costs, a, n, backward=backward).max()
            if pick_s is None or s < pick_s * (1.0 - 1e-9):
                pick, pick_s = n, s
        return pick
    return best(False), best(True)


def loads_from_plan(plan, *, ranks_per_node: int, token_bytes: float) -> list:
    """One :class:`LayerLoad` per rank from the compact dispatch plan every rank has
    (:class:`~ds_fssdp.planner.plan.DispatchPlan`; nodes are blocks of ``ranks_per_node`` ranks).

    Per exchange (a dispatch; its combine moves the same rows back): a rank's intra-node link
    carries the larger of the rows it sends to and receives from other ranks of its node, a node's
    inter-node link the larger of the rows the node sends to and receives from other nodes (one
    link per node, shared by its ranks). The exchange is one collective, so every rank's
    ``intra_bytes`` / ``inter_bytes`` are the group's busiest intra-node / inter-node link's, times
    ``token_bytes``. ``local_rows``: rows of d's own tokens it computes itself; ``remote_rows``:
    rows it computes for other ranks."""
    return loads_from_traffic(plan.traffic_DD(), ranks_per_node=ranks_per_node, token_bytes=token_bytes)


def loads_from_traffic(traffic_DD, *, ranks_per_node: int, token_bytes: float, sent_DD=None, side_D=None,
                       columns: bool = False) -> list:
    """:func:`loads_from_plan` from the plan's token traffic alone (``traffic_DD[d, h]``: rows rank d
    sends rank h, the diagonal stays; a recorded decision's ``traffic_DD``): rows rank h computes
    are its column's sum. ``sent_DD``: the rows that actually cross (one copy per destination sends
    fewer than it computes; the simulators' estimate), default ``traffic_DD``. ``side_D``: each
    rank's work beside the exchange (``side_rows``; default none). ``columns``: their
    :func:`load_columns` instead (what the pricing runs on; no objects built)."""
    rows_D = np.asarray(traffic_DD, dtype=np.float64).sum(0)
    local = np.diag(np.asarray(traffic_DD, dtype=np.float64))
    traffic = np.asarray(traffic_DD if sent_DD is None else sent_DD, dtype=np.float64)
    D, G = traffic.shape[0], int(ranks_per_node)
    node, intra, cross = _by_link(traffic, G)
    intra_out, intra_in = intra.sum(1), intra.sum(0)
    node_out = np.bincount(node, weights=cross.sum(1), minlength=D // G)
    node_in = np.bincount(node, weights=cross.sum(0), minlength=D // G)
    # The exchange (or a chunk of it) is one collective: a rank's rows have landed when the group's
    # busiest intra-node link and busiest inter-node link have moved theirs.
    intra_bytes = float(np.maximum(intra_out, intra_in).max()) * token_bytes
    inter_bytes = float(np.maximum(node_out, node_in).max()) * token_bytes
    cols = columns_of(intra_bytes, inter_bytes, local, rows_D - local, side_D)
    return cols if columns else loads_of(cols)


def columns_of(intra_bytes: float, inter_bytes: float, local_D, remote_D, side_D=None, relay_bytes: float = 0.0):
    """:func:`load_columns` of D ranks sharing their links (``side_D`` None: no side work)."""
    cols = np.empty((len(local_D), 6))
    cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], cols[:, 5] = intra_bytes, inter_bytes, local_D, remote_D, relay_bytes
    cols[:, 4] = 0.0 if side_D is None else side_D
    return cols


def loads_of(cols) -> list:
    """The :class:`LayerLoad` s of :func:`load_columns` ``cols``."""
    return [LayerLoad(*row[:4], relay_bytes=row[5], side_rows=row[4]) for row in np.asarray(cols).tolist()]


def _by_link(traffic_DD: np.ndarray, ranks_per_node: int) -> tuple:
    """(node of each rank [D], rows d sends h inside its node, rows d sends h across nodes), the
    diagonal (rows that stay) in neither."""
    node, intra, cross = _link_masks(traffic_DD.shape[0], int(ranks_per_node))
    return node, traffic_DD * intra, traffic_DD * cross


@functools.lru_cache(maxsize=16)
def _link_masks(D: int, G: int) -> tuple:
    """(node of each rank, 1.0 where d and h differ inside a node, 1.0 where they are in different
    nodes), read-only."""
    if G < 1 or D % G:
        raise ValueError(f"loads_from_plan: ranks_per_node ({G}) must divide the ranks ({D})")
    node = np.arange(D) // G
    same = node[:, None] == node[None, :]
    out = node, (1 - np.eye(D)) * same, (~same).astype(np.float64)
    for a in out:
        a.flags.writeable = False
    return out


# -- gradients in the gaps and replicas on the idle link (issue 24, items 4 and 5) ----------------
#
# The owned-expert gradient reduce over the EDP group of a layer runs during the backward of the
# layers below it, sliced so that each slice fits a gap the schedule leaves on the links (the
# seconds the layer below's backward keeps them idle while its GEMMs run). A layer's replica gather
# starts right after the previous layer's dispatch plan, so the window that hides it is the
# previous layer's exchange + expert compute and this layer's attention.

DEFAULT_GAP_SLICE_BYTES = 4 << 20  # a slice of the EDP gradient reduce where no costs exist (4 MiB)
MIN_GAP_SLICE_BYTES = 64 << 10  # below this a slice is mostly startup: never cut finer


def link_busy_s(costs: ScheduleCosts, load: LayerLoad, degree: int) -> float:
    """Seconds the links carry one direction's exchanges (dispatch and combine) at ``degree``."""
    return max(link_busy(costs, load, degree))


def idle_link_s(costs: ScheduleCosts, load: LayerLoad, degree: int, *, backward: bool = True) -> float:
    """The gap: seconds of one direction of the layer's modelled schedule (:func:`pipeline_time`)
    during which the links are idle (the expert GEMMs run): what a sliced gradient reduce may use."""
    gap = (pipeline_time(costs, load, degree, backward=backward) - link_busy_s(costs, load, degree)
           - other_traffic_s(costs, load, backward=backward))  # other traffic keeps the links busy too
    return gap if gap > 0.0 else 0.0


def gap_slice_bytes(reduce: Linear | None, gap_s: float | None, total_bytes: int, *,
                    default: int = DEFAULT_GAP_SLICE_BYTES) -> int:
    """Bytes of one slice of a layer's EDP gradient reduce: the largest slice whose modelled reduce
    (``reduce``: startup + seconds per byte) fits ``gap_s``, at least
    :data:`MIN_GAP_SLICE_BYTES`; ``default`` where no costs or no gap exist. Never more than
    ``total_bytes`` (one slice: the whole reduce), never less than 1."""
    if total_bytes <= 0:
        return 1
    if reduce is None or gap_s is None or not gap_s > 0.0:
        size = default
    elif reduce.per_unit_s <= 0.0:
        size = total_bytes
    else:
        room = gap_s - reduce.startup_s
        size = int(room / reduce.per_unit_s) if room > 0.0 else 0
        size = max(size, MIN_GAP_SLICE_BYTES)
    return int(max(1, min(size, total_bytes)))


def overlap_window(attention_s: float, previous_expert_s: float = 0.0, *, early: bool = True) -> float:
    """Seconds that hide a layer's replica gather: its attention's forward, plus, when the gather
    starts right after the previous MoE layer's dispatch plan (``early``, the runtime's schedule),
    that layer's token exchange and expert compute (``previous_expert_s``; 0 for the first layer,
    whose gather starts with the model's forward). The one window function: the runtime derives t
    from it (``CostModel.overlap_degree``) and a simulator calls it with its modelled times."""
    if attention_s < 0 or previous_expert_s < 0:
        raise ValueError(f"overlap window needs attention_s >= 0 ({attention_s}) and previous_expert_s >= 0 "
                         f"({previous_expert_s})")
    return attention_s + (previous_expert_s if early else 0.0)


def fit_schedule_costs(intra, inter, gemm_forward, gemm_backward, *, concurrent: bool = True) -> tuple:
    """The :class:`ScheduleCosts` fitted to measured samples, and the fit's relative error.

    ``intra`` / ``inter``: (bytes, seconds) pairs of exchanges over each link class (``inter``
    empty on one node: the inter-node link then takes the intra-node fit, never used); ``gemm_forward``
    / ``gemm_backward``: (rows, seconds) pairs of the grouped expert MLP. Each is a
    :func:`fit_linear` (startup + rate); ``backward_factor`` is the least-squares scale of the
    forward fit that best predicts the backward samples. The error is the largest of the four
    fits' median relative errors (``fit_linear``'s). ``concurrent``: :attr:`ScheduleCosts.concurrent`
    (the device's, not fitted)."""
    def usable(pairs, what):
        pairs = [(u, s) for u, s in pairs if u > 0 and s > 0]
        if len(pairs) < 2:
            raise ValueError(f"fit_schedule_costs: {what} needs >= 2 samples with units and seconds > 0, got "
                             f"{len(pairs)}")
        return pairs

    def fit(pairs, what):
        return fit_linear(*zip(*usable(pairs, what)))

    a2a_intra, e_intra = fit(intra, "intra")
    a2a_inter, e_inter = fit(inter, "inter") if len(inter) else (a2a_intra, 0.0)
    gemm, e_fwd = fit(gemm_forward, "gemm_forward")
    back = usable(gemm_backward, "gemm_backward")
    g = np.array([gemm(r) for r, _ in back])
    b = np.array([s for _, s in back])
    factor = float(g @ b / (g @ g)) if float(g @ g) > 0 else 2.0
    e_bwd = float(np.median(np.abs(factor * g - b) / b))
    costs = ScheduleCosts(a2a_intra=a2a_intra, a2a_inter=a2a_inter, gemm=gemm, backward_factor=factor,
                          concurrent=concurrent)
    return costs, max(e_intra, e_inter, e_fwd, e_bwd)


def link_busy(costs: ScheduleCosts, load: LayerLoad, degree: int) -> tuple:
    """(intra-node, inter-node) seconds the links spend on one direction's exchanges at ``degree``
    (n dispatch and n combine chunks, each with its startup): what is not free for other traffic
    (gradients in the gaps, replicas on the idle link) while :func:`pipeline_time` runs."""
    if degree < 1:
        raise ValueError(f"pipeline degree ({degree}) must be >= 1")
    n = degree
    relay = 2.0 * costs.a2a_inter(load.relay_bytes) if n == 1 else 2.0 * n * costs.a2a_inter(load.relay_bytes / n)
    return (2.0 * n * costs.a2a_intra(load.intra_bytes / n), 2.0 * n * costs.a2a_inter(load.inter_bytes / n) + relay)


def drain_in_gaps(work_L, gaps_L) -> float:
    """Seconds of a queue of transfers left after the gaps: ``work_L[i]`` is issued after step i
    (a layer's backward, in the order they run) and drains during the gaps ``gaps_L[j]`` of the
    steps after it (j > i), first issued first served. What the step still waits for (gradients
    in the gaps: the all-reduce slices sent while the links are not busy with the exchange)."""
    if len(work_L) != len(gaps_L):
        raise ValueError(f"work ({len(work_L)}) and gaps ({len(gaps_L)}) must have one entry per layer")
    queued = 0.0
    for work, gap in zip(work_L, gaps_L):
        queued = max(0.0, queued - max(0.0, gap)) + work
    return queued


def drain_before_deadlines(work_L, gaps_L, *, lead: int = 0) -> float:
    """Seconds a pass waits for a queue of transfers issued together before it: ``work_L[i]`` must
    have arrived before step ``i - lead`` begins (its first use; a deadline before the first step
    is the first step's), first issued first served; the queue drains during the gaps ``gaps_L[j]``
    of the steps already run and while the pass waits. What the pass waits in all (parameters in
    the gaps: the partitioned experts' all-gather after the optimizer step, before each layer's
    first use in the next forward)."""
    if len(work_L) != len(gaps_L):
        raise ValueError(f"work ({len(work_L)}) and gaps ({len(gaps_L)}) must have one entry per layer")
    if lead < 0:
        raise ValueError(f"lead ({lead}) must be >= 0")
    ran = [0.0]  # gap seconds of the steps before step j
    for gap in gaps_L:
        ran.append(ran[-1] + max(0.0, gap))
    need = waited = 0.0
    for i, work in enumerate(work_L):
        need += work
        waited = max(waited, need - ran[max(0, i - lead)])
    return waited


def split_sync_exposed(reduce_L, gather_L, backward_gaps_L, forward_gaps_L, *, lead: int) -> float:
    """Seconds a step waits for a sync split around it. Per layer in model order: ``reduce_L`` its
    reduce, issued after its backward and drained in the gaps below (``backward_gaps_L``, the
    backward runs the layers from the last: :func:`drain_in_gaps`); ``gather_L`` its all-gather,
    issued after the step and due before its first use in the next forward, ``lead`` layers early,
    drained in the forward's gaps (``forward_gaps_L``: :func:`drain_before_deadlines`). A sync
    whole before the step is the same with nothing to gather. What the simulators charge a gapped
    schedule and what :func:`split_sync_pays` compares."""
    return (drain_in_gaps(list(reduce_L)[::-1], list(backward_gaps_L)[::-1])
            + drain_before_deadlines(list(gather_L), list(forward_gaps_L), lead=lead))


def split_sync_inputs(expert_elems_L, grad_bytes: int, backward_gaps_L, forward_gaps_L, *,
                      allreduce, reduce_scatter, gather_bytes: int | None = None) -> tuple:
    """:func:`split_sync_pays`'s inputs for a ZeRO 0 step, per layer: the all-reduce, the
    reduce-scatter and the all-gather (the same bytes) of the experts' gradient reduced over the
    EDP group, ``expert_elems_L[i]`` elements of layer i per rank in ``grad_bytes`` each (the
    runtime sends its experts' gradients in DeepSpeed's communication dtype:
    ``planner/sync_dtype.expert_sync_bytes``, 2 under bf16 by default), and the gaps its layers' schedule
    leaves (``backward_gaps_L`` / ``forward_gaps_L``, at the degrees each layer runs at).
    ``allreduce`` / ``reduce_scatter``: seconds of that collective for a gradient of so many
    bytes per rank (an all-gather moves a reduce-scatter's). ``gather_bytes``: the all-gather's
    bytes per element where they differ (ZeRO >= 1 gathers the stepped rows in their dtype;
    None: ``grad_bytes``, a split step's summed gradient). The dense gradients are not in it:
    DeepSpeed's, after the backward, whether ours is split or not (the same seconds after either).
    The one place the runtime (``runtime/edp_sync.py``) and the simulators (``sim/sync.py``: their
    decision and their charge) build them."""
    nbytes_L = [float(e) * grad_bytes for e in expert_elems_L]
    halves_L = [reduce_scatter(b) for b in nbytes_L]
    gather_L = list(halves_L) if gather_bytes is None else [reduce_scatter(float(e) * gather_bytes)
                                                            for e in expert_elems_L]
    return [allreduce(b) for b in nbytes_L], halves_L, gather_L, list(backward_gaps_L), list(forward_gaps_L)


def split_sync_pays(allreduce_L, reduce_L, gather_L, backward_gaps_L, forward_gaps_L, *, lead: int) -> bool:
    """Whether a gradient all-reduce is slower whole than split around the step
    (:func:`split_sync_exposed` of each: ``allreduce_L`` per layer with nothing to gather, against
    ``reduce_L`` and ``gather_L``). What the runtime's replicated expert state decides its next
    step's sync with (ZeRO 0: the summed gradients gathered, each layer updated where they land),
    from its modelled gaps, and the simulators from theirs."""
    whole = split_sync_exposed(allreduce_L, [0.0] * len(allreduce_L), backward_gaps_L, forward_gaps_L, lead=lead)
    return split_sync_exposed(reduce_L, gather_L, backward_gaps_L, forward_gaps_L, lead=lead) < whole

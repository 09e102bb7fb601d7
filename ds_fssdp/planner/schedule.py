"""The schedule of one MoE layer (FSMoE, seed 002): the token exchange split into chunks that
pipeline with the expert compute, forward and backward each with its own degree.

Legend: n the pipeline degree (chunks per exchange).

Pure: costs and one rank's loads in, decisions and modelled seconds out. The runtime (its fitted
costs, its agreed loads), both simulators (their modelled hardware) and the report call these
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

The backward is the same pipeline over the gradients with ``backward_factor`` times the GEMM
work (input and weight gradients).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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

    def exchange(self, intra_bytes: float, inter_bytes: float) -> float:
        """One exchange (or one chunk of it): intra- and inter-node parts on their own streams."""
        return max(self.a2a_intra(intra_bytes), self.a2a_inter(inter_bytes))


@dataclass(frozen=True)
class LayerLoad:
    """One rank's share of a layer's exchange and compute (the straggler's, for a decision all
    ranks share): bytes it moves over its busiest intra-node and inter-node link per exchange, the
    rows it computes for its own tokens and for other ranks' tokens."""
    intra_bytes: float
    inter_bytes: float
    local_rows: float
    remote_rows: float


def pipeline_time(costs: ScheduleCosts, load: LayerLoad, degree: int, *, backward: bool = False) -> float:
    """Modelled seconds of one direction of the layer's exchange + expert compute + exchange back
    at ``degree`` (the module docstring's schedule)."""
    if degree < 1:
        raise ValueError(f"pipeline degree ({degree}) must be >= 1")
    factor = costs.backward_factor if backward else 1.0

    def gemm(rows: float) -> float:
        return factor * costs.gemm(rows)

    if degree == 1:
        x = costs.exchange(load.intra_bytes, load.inter_bytes)
        return 2.0 * x + gemm(load.local_rows + load.remote_rows)
    n = degree
    x = costs.exchange(load.intra_bytes / n, load.inter_bytes / n)
    g = gemm(load.remote_rows / n)
    # Links in the order D1 D2 C1 D3 C2 ... Dn C(n-1) Cn; compute: local, then G1 .. Gn.
    link, compute = 0.0, gemm(load.local_rows)
    done_d = [0.0] * (n + 1)
    done_g = [0.0] * (n + 1)
    order = _link_order(n)
    gi = 1
    for kind, i in order:
        if kind == "d":
            link = link + x
            done_d[i] = link
        else:
            while gi <= i:  # compute every chunk up to i (each after its dispatch)
                compute = max(compute, done_d[gi]) + g
                done_g[gi] = compute
                gi += 1
            link = max(link, done_g[i]) + x
    return link


def _link_order(n: int) -> list:
    order = [("d", 1)]
    for i in range(2, n + 1):
        order.append(("d", i))
        order.append(("c", i - 1))
    order.append(("c", n))
    return order


def choose_degree(costs: ScheduleCosts, load: LayerLoad, *, backward: bool, max_degree: int = MAX_DEGREE) -> int:
    """The degree with the least :func:`pipeline_time` (the smaller on a tie)."""
    best, best_s = 1, pipeline_time(costs, load, 1, backward=backward)
    for n in range(2, max_degree + 1):
        s = pipeline_time(costs, load, n, backward=backward)
        if s < best_s * (1.0 - 1e-9):
            best, best_s = n, s
    return best


def layer_time(costs: ScheduleCosts, load: LayerLoad, degrees: tuple) -> float:
    """Forward + backward of the layer's exchange and expert compute at ``degrees`` (fwd, bwd)."""
    return pipeline_time(costs, load, degrees[0]) + pipeline_time(costs, load, degrees[1], backward=True)


def choose_degrees(costs: ScheduleCosts, loads: list, *, max_degree: int = MAX_DEGREE) -> tuple:
    """(forward, backward) degrees of a layer for every rank at once (the exchange is one collective,
    so all ranks must chunk it alike): each direction's degree minimises the slowest rank's
    :func:`pipeline_time` over ``loads`` (one :class:`LayerLoad` per rank; the smaller on a tie)."""
    def best(backward: bool) -> int:
        pick, pick_s = 1, None
        for n in range(1, max_degree + 1):
            s = max(pipeline_time(costs, ld, n, backward=backward) for ld in loads)
            if pick_s is None or s < pick_s * (1.0 - 1e-9):
                pick, pick_s = n, s
        return pick
    return best(False), best(True)


def link_busy(costs: ScheduleCosts, load: LayerLoad, degree: int) -> tuple:
    """(intra-node, inter-node) seconds the links spend on one direction's exchanges at ``degree``
    (n dispatch and n combine chunks, each with its startup): what is not free for other traffic
    (gradients in the gaps, replicas on the idle link) while :func:`pipeline_time` runs."""
    if degree < 1:
        raise ValueError(f"pipeline degree ({degree}) must be >= 1")
    n = degree
    return (2.0 * n * costs.a2a_intra(load.intra_bytes / n), 2.0 * n * costs.a2a_inter(load.inter_bytes / n))


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

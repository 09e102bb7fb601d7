"""Cost-aware placement ("replicate only what pays"): the fewest replicas that reach a load level,
at the level whose modelled layer time is least.

Legend: E experts, D ranks, N nodes of G ranks.

``share[e, d]`` (rows of expert e computed on rank d) starts at expert parallelism: the owner
computes all of its expert's predicted tokens. A *move* sends x rows of an expert e from a rank d
to a rank r; a holder of e takes them for free (the balancing dispatcher moves those rows
anyway), otherwise r gets a replica, allowed only while r has a free slot (<= m added per rank)
and e is replicated already or fewer than t experts are. A move's *score* is what it keeps off
the links (the four token exchanges: a rank's, and a node's, own tokens of an expert are computed
there first; half of each end's change in rows, ``intra`` / ``inter`` seconds per row) less its
replica's exposed gather and reduce (below). Three phases:

* cover, once: for every (expert, node) the node produces tokens of but holds no replica of, most
  tokens first (lowest expert, then node, on ties), the best-scoring rank of the node (one with
  room below expert parallelism's slowest rank) takes ``min(tokens, room)`` rows from the
  expert's busiest holder elsewhere, when that scores more than ``MIN_GAIN`` of the mean rank's
  compute (tokens that would cross nodes stay home);
* level, per candidate ``level`` (rows per rank), from the covered state: every rank above
  ``target = level / (1 + margin)``, busiest first (lowest id on ties), sheds rows to it onto
  ranks below the level, never past it, one move at a time, the move with the largest
  ``row * x + score`` first (lowest expert, then rank, on ties); a rank no move relieves stays
  above (the fill did not reach its target: always so once the target is below the mean);
* localize, once, on the fill chosen (below): experts by predicted tokens, most first (lowest
  first on ties); each rank, in id order, that produces tokens of the expert, holds no replica of
  it and has a slot takes ``min(its tokens, room)`` rows from the expert's busiest holder (room:
  up to the fill's slowest rank) when the move scores above 0, within t. Ranks compute their own
  tokens where that keeps rows off the rank links (the cover's rows are a node's; on the simulated
  cluster B, where the network is almost as fast as a node's links and the window hides most of
  the gather, this is what the rank links carry). The localized fill replaces the chosen one when
  its token exchange plus exposed transfer is more than ``MIN_GAIN`` of the mean rank's compute
  lower (its compute cannot rise: replicas only end rigid rows): ranks keep their tokens home for
  what that saves on the links, not as a further hedge.

``margin`` is the headroom for the prediction's error: the runtime passes the load predictor's
measured relative L1 error (``LoadPredictor.error``: 0.14 on the shared trace, 0.6-0.8 for a
freshly initialised model whose routing swings), ``MARGIN`` when none was measured yet. Donors
shed to below the level by it, so the actual loads, which differ from the window mean the plan
sees, can still be balanced by the dispatcher. The modelled layer time of a fill is the slowest
rank's rows times ``row`` (forward + backward), or, if larger, ``1 + margin`` times the most
*rigid* rows of a rank (of experts only their owner holds, which no dispatch can move when the
prediction was short), plus the busiest link's exchange rows, plus the replicas' exposed
transfer: every link's expert chunks (a replica puts one on its rank's link and one on its
owner's; a replica in a node the expert has not entered yet also one on each node's link, then it
is forwarded inside the node), ``chunk_intra`` / ``chunk_inter`` seconds each; the busiest link's
gather time past ``window`` (the forward attention) plus its reduce time (as long) past
``2 * window`` (the backward attention). With margin 0 (an exact prediction) balanced loads buy
no replica; with a measured error they buy the hedge whose exposed transfer is worth it.

``cost_materialize`` takes the covered state, then the fills of the levels ``mean * (1 + s)`` for
``s`` in ``LEVELS`` (highest first) from it, stopping after a fill that does not reach its target;
then the same levels from expert parallelism, each fill covered after it is levelled (the cover
then has only the rows up to the fill's slowest rank, and t goes to balance first: when t binds,
as on the simulated cluster A with t = 6 and eight hot experts, covering first can spend it on
experts whose owners were not the ones to relieve; skipped when no cover can move a row, on one
node or when no node's tokens pass the cover's cut-off: it would repeat the first filling). It
returns the one with the least modelled time, a later fill replacing the best so far only when it
saves more than ``MIN_GAIN`` of the mean rank's compute (fewer replicas win near-ties); then it
localizes that fill.
So a replica is bought only when it lowers the modelled time by more than its share of the
gather and reduce that the window does not hide; m and t stay upper bounds. Deterministic; the C
version (``_costplace.c``) does the same float operations in the same order, tested equal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_fssdp.planner import fast
from ds_fssdp.planner.cost import exposed_transfer
from ds_fssdp.topology import Topology

# Candidate levels (mean rank rows * (1 + s)), highest first: finer than 2% the balancing
# dispatcher's 3% slack gives the balance back for locality.
LEVELS = (0.5, 0.2, 0.1, 0.05, 0.02)
MARGIN = 0.15  # headroom for the load prediction's error (relative L1 0.14 on the shared trace)
MAX_MARGIN = 1.0  # a measured error past it keeps no more headroom (donors shed to half the level)
_LEVELS = torch.tensor(LEVELS, dtype=torch.float64)
MIN_GAIN = 0.01  # a lower level must save 1% of the mean rank's compute


@dataclass(frozen=True)
class Coefficients:
    """Seconds: per row computed (forward + backward), per row over a rank link and over a node
    link (four exchanges together), per expert chunk over a rank link and over a node link, and the
    forward overlap window of one layer (the backward's is twice it)."""

    row: float
    intra: float
    inter: float
    chunk_intra: float
    chunk_inter: float
    window: float

    @classmethod
    def from_cost(cls, cost, overlap_degree: int) -> "Coefficients":
        """From a :class:`~ds_fssdp.planner.cost.CostModel`; the window is its
        :meth:`~ds_fssdp.planner.cost.CostModel.overlap_window` for t."""
        hw, shape = cost.hw, cost.shape
        psi, row_bytes = float(shape.expert_bytes), 4.0 * shape.token_bytes
        return cls(row=3.0 * shape.row_flops / hw.flops, intra=row_bytes / hw.intra_bw, inter=row_bytes / hw.inter_bw,
                   chunk_intra=psi / hw.intra_bw, chunk_inter=psi / hw.inter_bw,
                   window=cost.overlap_window(overlap_degree))


def cost_materialize(owner_E: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *, overlap_degree: int,
                     budget: int, coefficients: Coefficients, margin: float = MARGIN) -> torch.Tensor:
    """Return placement_ED (bool [E, D]); in C when the extension is built (same result)."""
    _check(owner_E, tokens_ED, topology, overlap_degree, budget)
    if fast.AVAILABLE:
        return fast.materialize_cost(owner_E, tokens_ED, topology, overlap_degree, budget, coefficients, _LEVELS,
                                     margin, MIN_GAIN)
    return cost_materialize_reference(owner_E, tokens_ED, topology, overlap_degree=overlap_degree, budget=budget,
                                      coefficients=coefficients, margin=margin)


def _check(owner_E, tokens_ED, topology, overlap_degree, budget) -> None:
    E = owner_E.numel()
    if tuple(tokens_ED.shape) != (E, topology.num_ranks):
        raise ValueError(f"tokens_ED {tuple(tokens_ED.shape)} does not match {E} experts on {topology.num_ranks} "
                         f"ranks")
    if overlap_degree < 0 or budget < 0:
        raise ValueError(f"overlap_degree ({overlap_degree}) and budget ({budget}) must be >= 0")


def cost_materialize_reference(owner_E: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *,
                               overlap_degree: int, budget: int, coefficients: Coefficients,
                               margin: float = MARGIN) -> torch.Tensor:
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
    t = min(overlap_degree, E)
    base = _Fill(owner, T, D, G, t, budget, coefficients)
    mean = base.mean
    gain = MIN_GAIN * coefficients.row * mean
    ep = base.copy()
    base.cover(gain)
    best, best_time = base, base.time(margin)
    # Cover, then level; and level from expert parallelism, then cover (t spent on balance first),
    # unless no cover can move a row (one node, or no node's tokens worth it): the same fills again.
    covers = any(base.made[e][n] * (coefficients.intra + coefficients.inter) > gain
                 for e in range(E) for n in range(base.N) if n != owner[e] // G)
    for start, cover_after in ((base, False), (ep, True))[:2 if covers else 1]:
        top = max(start.load)
        for s in LEVELS:
            level = mean * (1.0 + s)
            target = level / (1.0 + margin)
            if target >= top:
                continue
            fill = start.copy()
            reached = fill.level(target, level)
            if cover_after:
                fill.cover(gain)
            time = fill.time(margin)
            if time < best_time - gain:
                best, best_time = fill, time
            if not reached:  # the slots ran out: a lower level only adds replicas to the same straggler
                break
    # Ranks compute their own tokens of the replicated experts where that pays (within the slowest rank).
    local = best.copy()
    local.localize()
    if local.transfer() < best.transfer() - gain:
        best = local
    return torch.tensor(best.held, dtype=torch.bool).reshape(E, D)


class _Fill:
    """The shares, links and replicas of one fill, from expert parallelism (module docstring)."""

    def __init__(self, owner, T, D, G, t, m, c: Coefficients):
        E, N = len(owner), D // G
        self.owner, self.T, self.D, self.G, self.N, self.t, self.c = owner, T, D, G, N, t, c
        self.total = total = [0.0] * E  # predicted tokens of each expert (read only)
        for e in range(E):
            for d in range(D):
                total[e] += T[e][d]
        self.held = [[False] * D for _ in range(E)]
        self.share = [[0.0] * D for _ in range(E)]
        self.made = [[0.0] * N for _ in range(E)]  # tokens of e produced in node n
        self.node_share = [[0.0] * N for _ in range(E)]  # rows of e computed in node n
        self.node_has = [[False] * N for _ in range(E)]
        self.load = [0.0] * D
        self.computing = [[] for _ in range(D)]  # experts with rows on rank d, ascending
        self.mean = 0.0
        for e, o in enumerate(owner):
            self.held[e][o] = True
            self.share[e][o] = total[e]
            self.node_share[e][o // G] = total[e]
            self.node_has[e][o // G] = True
            self.load[o] += total[e]
            self.mean += total[e]
            self.computing[o].append(e)
            for d in range(D):
                self.made[e][d // G] += T[e][d]
        self.mean /= D
        # Exchange rows on each link: computed here but produced elsewhere (in), and the reverse.
        self.rin, self.rout, self.nin, self.nout = [0.0] * D, [0.0] * D, [0.0] * N, [0.0] * N
        for d in range(D):
            for e in range(E):
                self.rin[d] += _pos(self.share[e][d] - T[e][d])
                self.rout[d] += _pos(T[e][d] - self.share[e][d])
        for n in range(N):
            for e in range(E):
                self.nin[n] += _pos(self.node_share[e][n] - self.made[e][n])
                self.nout[n] += _pos(self.made[e][n] - self.node_share[e][n])
        self.free = [m] * D
        self.replicated = [False] * E
        self.distinct = 0
        self.links = [[0] * D, [0] * D, [0] * N, [0] * N]  # chunks: rank in, rank out, node in, node out
        self.gather = 0.0  # the busiest link's gather time

    def copy(self) -> "_Fill":
        f = object.__new__(_Fill)
        f.__dict__.update(self.__dict__)
        for k in ("held", "share", "node_share", "node_has", "computing", "links"):
            setattr(f, k, [row[:] for row in getattr(self, k)])
        for k in ("load", "rin", "rout", "nin", "nout", "free", "replicated"):
            setattr(f, k, getattr(self, k)[:])
        return f

    def score(self, e, d, r, x) -> float:
        """What moving x rows of e from d to r keeps off the links, less its replica's exposed cost."""
        c, G = self.c, self.G
        a, b = d // G, r // G
        price = 0.0
        if not self.held[e][r]:
            g = _gather_with(self.links, self.gather, self.owner[e], r, self.node_has[e][b], G, c)
            price = exposed_transfer(g, c.window) - exposed_transfer(self.gather, c.window)
        share, T, made, node_share = self.share, self.T, self.made, self.node_share
        ranks = _moved(share[e][d], T[e][d], -x) + _moved(share[e][r], T[e][r], x)
        nodes = 0.0
        if b != a:
            nodes = _moved(node_share[e][a], made[e][a], -x) + _moved(node_share[e][b], made[e][b], x)
        return -0.5 * (c.intra * ranks + c.inter * nodes) - price

    def move(self, e, d, r, x, goal, level) -> None:
        """x rows of e from d to r (d's load exact at ``goal`` when x is its excess over it, r's at
        ``level`` when x is its room: every move ends a donor, fills a receiver or empties a share)."""
        G, T, share, load = self.G, self.T, self.share, self.load
        a, b = d // G, r // G
        if not self.held[e][r]:
            self.gather = _gather_with(self.links, self.gather, self.owner[e], r, self.node_has[e][b], G, self.c,
                                       add=True)
            self.node_has[e][b] = True
            self.held[e][r] = True
            self.free[r] -= 1
            self.computing[r] = sorted(self.computing[r] + [e])
            if not self.replicated[e]:
                self.replicated[e] = True
                self.distinct += 1
        rin, rout, nin, nout, made, node_share = self.rin, self.rout, self.nin, self.nout, self.made, self.node_share
        rin[d], rout[d] = _link_after(rin[d], rout[d], share[e][d], T[e][d], -x)
        rin[r], rout[r] = _link_after(rin[r], rout[r], share[e][r], T[e][r], x)
        if b != a:
            nin[a], nout[a] = _link_after(nin[a], nout[a], node_share[e][a], made[e][a], -x)
            nin[b], nout[b] = _link_after(nin[b], nout[b], node_share[e][b], made[e][b], x)
            node_share[e][a] -= x
            node_share[e][b] += x
        spare, excess = level - load[r], load[d] - goal
        share[e][d] = 0.0 if x == share[e][d] else share[e][d] - x
        share[e][r] += x
        load[d] = goal if x == excess else load[d] - x
        load[r] = level if x == spare else load[r] + x

    def cover(self, gain) -> None:
        """A node that produces tokens of an expert it lacks gets a holder, most tokens first, fed
        from the expert's busiest holder elsewhere, no rank past expert parallelism's slowest,
        where that saves more than ``gain``."""
        E, D, G, N, c = len(self.owner), self.D, self.G, self.N, self.c
        top = max(self.load)
        made, share = self.made, self.share
        pairs = sorted((-made[e][n], e, n) for e in range(E) for n in range(N)
                       if made[e][n] > 0.0 and not self.node_has[e][n])
        for neg_made, e, n in pairs:
            if -neg_made * (c.intra + c.inter) <= gain:  # a move of x <= made rows changes each link by <= x
                break
            if not (self.replicated[e] or self.distinct < self.t):
                continue
            h = -1
            for d in range(D):
                if d // G != n and share[e][d] > 0.0 and (h < 0 or share[e][d] > share[e][h]):
                    h = d
            best = None  # (score, r, x)
            for r in range(n * G, (n + 1) * G):
                if self.free[r] <= 0 or self.load[r] >= top:  # (no rank of n holds e: each pair comes once)
                    continue
                x = min(share[e][h], made[e][n], top - self.load[r])
                v = self.score(e, h, r, x)
                if best is None or v > best[0]:
                    best = (v, r, x)
            if best is not None and best[0] > gain:
                self.move(e, h, best[1], best[2], -1.0, top)

    def localize(self) -> None:
        """Ranks without a replica of an expert they produce tokens of get one, computing their
        own tokens of it (taken from its busiest holder) where the move scores above 0 and leaves
        them no busier than the slowest rank: experts by predicted tokens, most first (lowest
        first on ties), ranks in id order, while slots and t allow."""
        E, D, T, share = len(self.owner), self.D, self.T, self.share
        top = max(self.load)
        for e in sorted(range(E), key=lambda e: (-self.total[e], e)):
            if not (self.replicated[e] or self.distinct < self.t):
                continue
            h = -1
            for r in range(D):
                if h < 0:  # the busiest holder (lowest id on ties), again after each move
                    for d in range(D):
                        if share[e][d] > 0.0 and (h < 0 or share[e][d] > share[e][h]):
                            h = d
                    if h < 0:
                        break
                if self.held[e][r] or self.free[r] <= 0 or T[e][r] <= 0.0:
                    continue
                if not (self.replicated[e] or self.distinct < self.t):
                    break
                x = min(share[e][h], T[e][r], top - self.load[r])
                if x > 0.0 and self.score(e, h, r, x) > 0.0:
                    self.move(e, h, r, x, -1.0, top)
                    h = -1

    def level(self, target, level) -> bool:
        """Every rank above ``target`` sheds rows to it, busiest first, onto ranks below ``level``;
        False when a rank is left above (no move relieves it)."""
        D, c, load, share = self.D, self.c, self.load, self.share
        for d in sorted(range(D), key=lambda d: (-load[d], d)):
            if load[d] <= target:
                break
            while load[d] > target:
                best = None  # (value, e, r, x)
                for e in self.computing[d]:
                    s = share[e][d]
                    if s <= 0.0:
                        continue
                    can_add = self.replicated[e] or self.distinct < self.t
                    for r in range(D):
                        if r == d or load[r] >= level or not (self.held[e][r] or (self.free[r] > 0 and can_add)):
                            continue
                        x = min(s, load[d] - target, level - load[r])
                        v = c.row * x + self.score(e, d, r, x)
                        if best is None or v > best[0]:
                            best = (v, e, r, x)
                if best is None:
                    return False
                self.move(best[1], d, best[2], best[3], target, level)
        return True

    def exchange(self) -> float:
        """The busiest link's token exchange time."""
        c = self.c
        return max(max(max(self.rin), max(self.rout)) * c.intra, max(max(self.nin), max(self.nout)) * c.inter)

    def transfer(self) -> float:
        """The modelled layer time's token exchange plus the replicas' exposed transfer."""
        return self.exchange() + exposed_transfer(self.gather, self.c.window)

    def time(self, margin: float) -> float:
        """The modelled layer time (module docstring)."""
        c = self.c
        exchange = self.exchange()
        rigid = [0.0] * self.D  # rows of experts only their owner holds: no dispatch can move them
        for e, o in enumerate(self.owner):
            if not self.replicated[e]:
                rigid[o] += self.share[e][o]
        compute = max(max(self.load), (1.0 + margin) * max(rigid)) * c.row
        return compute + exchange + exposed_transfer(self.gather, c.window)


def _pos(v: float) -> float:
    return v if v > 0.0 else 0.0


def _link_after(rows_in: float, rows_out: float, computed: float, produced: float, dx: float) -> tuple:
    """A link's (in, out) exchange rows once the rows of one expert computed behind it change by
    ``dx`` (it carries what is computed there but produced elsewhere in, and the reverse out)."""
    after = computed + dx
    return (rows_in - _pos(computed - produced) + _pos(after - produced),
            rows_out - _pos(produced - computed) + _pos(produced - after))


def _moved(computed: float, produced: float, dx: float) -> float:
    """How the rows a link carries for one expert change when the rows computed behind it change
    by ``dx``."""
    after, before = computed + dx - produced, computed - produced
    return (after if after > 0.0 else -after) - (before if before > 0.0 else -before)


def _gather_with(links, gather, o, r, entered, G, c: Coefficients, *, add=False) -> float:
    """The busiest link's gather time once rank r also holds a replica of an expert owned by o
    (``entered``: r's node holds the expert already); ``add``: count its chunks in ``links``.

    A replica's rank receives one chunk; its owner sends one to each holder in its node and one
    into each other node the expert enters, where the first holder forwards it."""
    rank_in, rank_out, node_in, node_out = links
    a, b = o // G, r // G
    cross = a != b and not entered
    out = rank_out[o] + (1 if a == b or cross else 0)
    gather = max(gather, (rank_in[r] + 1) * c.chunk_intra, out * c.chunk_intra)
    if cross:
        gather = max(gather, (node_in[b] + 1) * c.chunk_inter, (node_out[a] + 1) * c.chunk_inter)
    if add:
        rank_in[r] += 1
        rank_out[o] = out
        if cross:
            node_in[b] += 1
            node_out[a] += 1
    return gather


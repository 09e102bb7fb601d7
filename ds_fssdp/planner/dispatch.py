"""Algorithm 3, topology-aware token dispatching: which holder computes which tokens.

Legend: E experts, D ranks (source d, destination d2).

``plan_EDD[e, d, d2]`` is the number of rank d's tokens for expert e that rank d2 computes. A
token stays local if its rank holds the expert; otherwise it is split evenly over the holders in
its node, and only if its node holds none, evenly over all holders. Integer split: the remainder
goes to the holders that follow the source rank cyclically, so remainders from different sources
land on different holders. Deterministic: every rank computes the same plan from the same
all-gathered ``tokens_ED``.
"""
from __future__ import annotations

import torch

from ds_fssdp.planner import fast
from ds_fssdp.planner.plan import DispatchPlan
from ds_fssdp.planner.balance import balanced_dispatch, check_dispatch_inputs
from ds_fssdp.topology import Topology


DISPATCH_MODES = ("paper", "balanced", "balanced-time")


def dispatch(placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *, mode: str = "paper",
             cost=None, slack: float = 0.0) -> torch.Tensor:
    """Return plan_EDD (long [E, D, D]); sums over d2 give back ``tokens_ED``.

    ``mode="paper"``: Algorithm 3 as written (this module). ``mode="balanced"``: minimise the
    most loaded rank's rows, locality second (``planner.balance``). ``mode="balanced-time"``: the
    plan with the least modelled layer time (needs ``cost``, a ``planner.CostModel``). ``slack``
    (balanced): the row cap may exceed the bound by this fraction, so fewer tokens leave their
    node."""
    if mode == "balanced":
        return balanced_dispatch(placement_ED, tokens_ED, topology, slack=slack)
    if mode == "balanced-time":
        if cost is None:
            raise ValueError("dispatch mode 'balanced-time' needs a cost model (cost=...)")
        return time_balanced_dispatch(placement_ED, tokens_ED, topology, cost=cost)
    if mode != "paper":
        raise ValueError(f"dispatch mode ({mode!r}) must be one of {DISPATCH_MODES}")
    return paper_dispatch(placement_ED, tokens_ED, topology)


def dispatch_plan(placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *, mode: str = "paper",
                  cost=None, slack: float = 0.0):
    """The same plan as :func:`dispatch`, as a compact :class:`DispatchPlan` (what the runtime
    uses every iteration: no dense [E, D, D] tensor)."""
    if fast.AVAILABLE and (mode == "balanced" or mode == "paper"):
        return fast.dispatch_compact(placement_ED, tokens_ED, topology, mode == "balanced", slack)  # checks shapes
    return DispatchPlan.from_dense(placement_ED, dispatch(placement_ED, tokens_ED, topology, mode=mode, cost=cost,
                                                          slack=slack))


TIME_SLACKS = (0.0, 0.02, 0.05, 0.1, 0.2)


def time_balanced_dispatch(placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *,
                           cost, slacks=TIME_SLACKS) -> torch.Tensor:
    """Balance modelled rank *time* (expert compute + token exchange over intra- and inter-node
    links, ``planner.cost``), not only rows: among the row-balanced plans with the cap ``slacks``
    above the bound (a looser cap moves fewer tokens, across nodes last) and Algorithm 3's
    locality-first plan, return the one with the least modelled layer time (ties: the first)."""
    candidates = [balanced_dispatch(placement_ED, tokens_ED, topology, slack=s) for s in slacks]
    candidates.append(paper_dispatch(placement_ED, tokens_ED, topology))
    times = [cost.layer_time(plan) for plan in candidates]
    return candidates[min(range(len(times)), key=times.__getitem__)]


def paper_dispatch(placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Algorithm 3 (in C when the extension is built)."""
    check_dispatch_inputs(placement_ED, tokens_ED)
    return (fast.dispatch_paper if fast.AVAILABLE else paper_dispatch_reference)(placement_ED, tokens_ED, topology)


def paper_dispatch_reference(placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Algorithm 3 in Python: the specification the C version is tested against."""
    check_dispatch_inputs(placement_ED, tokens_ED)
    placement_ED = placement_ED.to("cpu", torch.bool)
    tokens_ED = tokens_ED.to("cpu", torch.long)
    num_experts, num_ranks = placement_ED.shape
    same_node_DD = topology.same_node_DD()
    plan_EDD = torch.zeros(num_experts, num_ranks, num_ranks, dtype=torch.long)
    ranks = torch.arange(num_ranks)
    for e in range(num_experts):
        holds_D = placement_ED[e]
        # Local first.
        plan_EDD[e, ranks[holds_D], ranks[holds_D]] = tokens_ED[e, holds_D]
        for d in torch.nonzero(~holds_D & (tokens_ED[e] > 0)).flatten().tolist():
            targets_D = holds_D & same_node_DD[d]
            if not bool(targets_D.any()):
                targets_D = holds_D
            plan_EDD[e, d] = even_split(int(tokens_ED[e, d]), targets_D, start=d)
    return plan_EDD


def even_split(count: int, targets_D: torch.Tensor, *, start: int) -> torch.Tensor:
    """Split ``count`` over the True ranks of ``targets_D``; the remainder goes to the targets
    that follow rank ``start`` cyclically."""
    targets = torch.nonzero(targets_D).flatten()
    n = targets.numel()
    q, r = divmod(count, n)
    out_D = torch.zeros(targets_D.numel(), dtype=torch.long)
    out_D[targets] = q
    if r:
        first = int((targets >= start).long().argmax()) if bool((targets >= start).any()) else 0
        out_D[targets[(first + torch.arange(r)) % n]] += 1
    return out_D


def rows_per_rank(plan_EDD: torch.Tensor) -> torch.Tensor:
    """Rows each rank computes (long [D])."""
    return plan_EDD.sum((0, 1))


def straggler_factor(plan_EDD: torch.Tensor) -> float:
    """max / mean rows computed per rank (1.0 is perfect balance)."""
    rows_D = rows_per_rank(plan_EDD).double()
    mean = float(rows_D.mean())
    return float(rows_D.max()) / mean if mean > 0 else 1.0

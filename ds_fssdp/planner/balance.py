"""Balancing dispatch: split each expert's tokens among its holders so that the most loaded rank
computes as few rows as the placement allows; among such plans keep tokens local, then inside
their node.

Legend: E experts, D ranks (source d, holder h), X replicated experts (more than one holder),
F flows (replicated expert, source rank) with tokens.

Algorithm 3 splits a non-holder's tokens evenly and keeps every holder's local tokens, so a rank
that holds a hot expert takes all its own tokens of it plus an even share of everyone else's.
Here:

1. Experts with one holder are fixed: their rows land on that rank (``base_D``).
2. A row cap C = ceil(bound): the bound on the best achievable maximum is the larger of
   max(base_D), the mean rows per rank and, for sets S of replicated experts,
   (load(S) + base of S's holders) / |holders of S| (Hall's condition; with all sets, as used
   up to 10 replicated experts, it equals the optimum of splittable assignment).
3. Greedy fill under the cap: each holder keeps its own tokens of an expert, then the holders
   in the source's node take the rest, the one with the most room first.
4. What does not fit travels along augmenting paths (a max-flow from the greedy start: a path may
   move another source's tokens off a full holder to make room): first paths that keep every token
   in its node, then straight to any holder with room, then paths that may cross nodes (same-node
   edges still explored first).
   Integer capacities give integer flows, so if the bound is reached fractionally it is reached
   here. If nothing fits (the bound was not exact), C grows by 1% and the search continues.

Integer plans, tokens conserved, tokens sent only to holders, deterministic.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

from ds_fssdp.planner import fast
from ds_fssdp.topology import Topology

_EXACT_SETS = 10  # enumerate all subsets of replicated experts up to this many


def balanced_dispatch(placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *,
                      slack: float = 0.0) -> torch.Tensor:
    """Return plan_EDD (long [E, D, D]) minimising the most loaded rank's rows, locality second;
    in C when the extension is built (same result as the reference). ``slack``: allow the row
    cap ``slack`` above the bound (fewer tokens move to reach it)."""
    if slack < 0:
        raise ValueError(f"slack ({slack}) must be >= 0")
    if fast.AVAILABLE:
        check_dispatch_inputs(placement_ED, tokens_ED)
        return fast.dispatch_balanced(placement_ED, tokens_ED, topology, slack)
    return balanced_dispatch_reference(placement_ED, tokens_ED, topology, slack=slack)


def check_dispatch_inputs(placement_ED: torch.Tensor, tokens_ED: torch.Tensor) -> None:
    """A dispatcher's inputs: one shape, and every expert held somewhere."""
    if tuple(tokens_ED.shape) != tuple(placement_ED.shape):
        raise ValueError(f"tokens_ED {tuple(tokens_ED.shape)} and placement_ED {tuple(placement_ED.shape)} differ")
    if not bool(placement_ED.any(1).all()):
        raise ValueError("every expert needs at least one holder in placement_ED")


def balanced_dispatch_reference(placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology, *,
                                slack: float = 0.0) -> torch.Tensor:
    """The Python specification the C version is tested against."""
    check_dispatch_inputs(placement_ED, tokens_ED)
    P = placement_ED.to("cpu", torch.bool).numpy()
    T = tokens_ED.to("cpu", torch.long).numpy().astype(np.int64)
    E, D = P.shape
    holders_E = P.sum(1)
    node_D = topology.node_D().numpy()
    plan = np.zeros((E, D, D), dtype=np.int64)
    single = np.nonzero(holders_E == 1)[0]
    owner_single = P[single].argmax(1)
    plan[single, :, owner_single] = T[single]
    base_D = np.zeros(D, dtype=np.int64)
    np.add.at(base_D, owner_single, T[single].sum(1))
    rep = np.nonzero(holders_E > 1)[0]
    if rep.size:
        cap = int(math.ceil(row_bound(P[rep], T[rep].sum(1), base_D) * (1.0 + slack) - 1e-9))
        plan[rep] = _FlowFill(P[rep], T[rep], base_D, node_D, cap).run()
    return torch.from_numpy(plan)


def row_bound(P_XD: np.ndarray, load_X: np.ndarray, base_D: np.ndarray) -> float:
    """Lower bound on the most loaded rank's rows (exact for splittable rows when X <= 10)."""
    D = base_D.size
    bound = max(float(base_D.max()), (float(base_D.sum()) + float(load_X.sum())) / D)
    X = load_X.size
    if X == 0:
        return bound
    if X <= _EXACT_SETS:
        masks = ((np.arange(1, 1 << X)[:, None] >> np.arange(X)) & 1).astype(bool)  # [2^X - 1, X]
    else:  # singletons and the hottest prefixes (row i: the i + 1 hottest)
        rank_X = np.argsort(np.argsort(-load_X, kind="stable"))
        masks = np.vstack([np.eye(X, dtype=bool), np.tri(X, dtype=bool)[:, rank_X]])
    reach = (masks.astype(np.int64) @ P_XD.astype(np.int64)) > 0  # holders of each set
    num = masks @ load_X + reach @ base_D
    return max(bound, float((num / reach.sum(1)).max()))


class _FlowFill:
    """Max-flow of tokens (replicated expert, source) -> holder under a per-rank row cap."""

    def __init__(self, P_XD, T_XD, base_D, node_D, cap):
        self.P, self.T, self.node = P_XD, T_XD, node_D
        self.X, self.D = P_XD.shape
        self.rows = base_D.copy()
        self.cap = cap
        self.flow = np.zeros((self.X, self.D, self.D), dtype=np.int64)  # [x, source d, holder h]
        self.rem = T_XD.copy()
        self.holders = [np.nonzero(P_XD[x])[0] for x in range(self.X)]

    def room(self, h):
        return self.cap - int(self.rows[h])

    def move(self, x, d, h, k):
        self.flow[x, d, h] += k
        self.rows[h] += k

    def run(self):
        self._greedy()
        while self.rem.any() and self._augment(cross=False):
            pass
        self._direct_cross()
        while self.rem.any():
            if not self._augment(cross=True):
                self.cap = max(self.cap + 1, int(math.ceil(self.cap * 1.01)))
        return self.flow

    def _greedy(self):
        # Experts with the fewest holders first: they have the fewest alternatives.
        order = sorted(range(self.X), key=lambda x: (self.holders[x].size, -int(self.T[x].sum()), x))
        for x in order:
            for h in self.holders[x]:  # a holder keeps its own tokens
                k = min(int(self.rem[x, h]), max(0, self.room(h)))
                if k:
                    self.move(x, h, h, k)
                    self.rem[x, h] -= k
            for d in np.nonzero(self.rem[x])[0]:  # then holders in the source's node
                self._fill_most_room(x, d, self.holders[x][self.node[self.holders[x]] == self.node[d]])

    def _direct_cross(self):
        """What is left after the same-node paths goes straight to a holder with room in another
        node, the one with the most room first (a one-edge augmenting path, without a search)."""
        for x, d in zip(*np.nonzero(self.rem)):
            self._fill_most_room(x, d, self.holders[x])

    def _fill_most_room(self, x, d, candidates):
        """Source d's tokens of x left to place go to ``candidates`` (holders of x), the one with
        the most room first, while any has room."""
        while self.rem[x, d] and candidates.size:
            rooms = self.cap - self.rows[candidates]
            best = int(np.argmax(rooms))
            if rooms[best] <= 0:
                break
            k = int(min(self.rem[x, d], rooms[best]))
            self.move(x, d, candidates[best], k)
            self.rem[x, d] -= k

    def _augment(self, *, cross: bool) -> bool:
        """Augmenting paths from sources with tokens left to holders with room. Breadth first
        over holders, same-node edges before others; ``cross=False`` never moves a token out of
        its node. Every holder with room the search reaches ends a path (it is not searched
        past), pushed with its bottleneck if earlier pushes of this search left one. Returns
        False if nothing was pushed."""
        prev = {}  # holder -> (x, source d, previous holder or None)
        queue = deque()
        starts = [(x, d) for x, d in zip(*np.nonzero(self.rem))]
        tiers = (True, False) if cross else (True, )
        for same in tiers:
            for x, d in starts:
                for h in self.holders[x]:
                    if h not in prev and (self.node[h] == self.node[d]) == same:
                        prev[h] = (x, d, None)
                        queue.append(h)
        pushed = False
        while queue:
            h = queue.popleft()
            if self.room(h) > 0:
                if self._push(h, prev):
                    pushed = True
                    if not self.rem.any():
                        return True
                continue
            # Tokens currently on h that could go to another holder of their expert.
            for x, d in zip(*np.nonzero(self.flow[:, :, h])):
                for same in tiers:
                    for h2 in self.holders[x]:
                        if h2 not in prev and (self.node[h2] == self.node[d]) == same:
                            prev[h2] = (x, d, h)
                            queue.append(h2)
        return pushed

    def _push(self, end, prev):
        path, h = [], end
        while h is not None:
            x, d, before = prev[h]
            path.append((x, d, before, h))
            h = before
        path.reverse()
        x0, d0, _, _ = path[0]
        k = min(int(self.rem[x0, d0]), self.room(end))
        for x, d, before, h in path[1:]:
            k = min(k, int(self.flow[x, d, before]))
        if k <= 0:
            return False
        for x, d, before, h in path:
            if before is not None:
                self.flow[x, d, before] -= k
                self.rows[before] -= k
            self.move(x, d, h, k)
        self.rem[x0, d0] -= k
        return True


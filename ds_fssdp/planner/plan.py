"""A dispatch plan without the dense [E, D, D] tensor.

Legend: E experts, D ranks (source d, holder h), X experts with more than one holder, F flows
that carry tokens.

Most experts have a single holder, and all their tokens go to it: the placement says where. Only
the X replicated experts need flows, and of their X * D * D (source, holder) pairs only the F that
carry tokens are kept. At E = 64, D = 32 the dense plan is 65k int64 entries (half a megabyte to
zero every layer, every iteration); this keeps ``tokens_ED``, the single holders and the F flows
as rows (x, h, d, k), and answers what the runtime asks: what this rank sends, what it receives,
rows per rank, rank-to-rank traffic. ``dense()`` gives ``plan_EDD`` for everything else.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ds_fssdp.planner.prices import _fastplan  # the planner's C, None where not built


@dataclass(slots=True)
class DispatchPlan:  # read-only by convention (slots, not frozen: built every layer, every iteration)
    tokens_ED: np.ndarray  # int64 [E, D]
    holder_E: np.ndarray  # int64 [E]: the holder of a single-holder expert, -1 if replicated
    rep_X: np.ndarray  # int64 [X]: the replicated experts, ascending
    flows_4F: np.ndarray  # int64 [4, F]: rows x, h, d, k: holder h takes k > 0 tokens of rep_X[x] from source d

    @property
    def shape(self) -> tuple:
        E, D = self.tokens_ED.shape
        return (E, D, D)

    def sent(self, rank: int) -> torch.Tensor:
        """plan_EDD[:, rank, :]: this rank's tokens per expert and destination (long [E, D])."""
        E, D = self.tokens_ED.shape
        out = np.zeros((E, D), dtype=np.int64)
        single = np.flatnonzero(self.holder_E >= 0)
        out[single, self.holder_E[single]] = self.tokens_ED[single, rank]
        fl = self.flows_4F
        mine = fl[2] == rank
        out[self.rep_X[fl[0, mine]], fl[1, mine]] = fl[3, mine]
        return torch.from_numpy(out)

    def received(self, rank: int) -> torch.Tensor:
        """plan_EDD[:, :, rank]: tokens this rank computes per expert and source (long [E, D])."""
        E, D = self.tokens_ED.shape
        out = np.zeros((E, D), dtype=np.int64)
        mine = np.flatnonzero(self.holder_E == rank)
        out[mine] = self.tokens_ED[mine]
        fl = self.flows_4F
        here = fl[1] == rank
        out[self.rep_X[fl[0, here]], fl[2, here]] = fl[3, here]
        return torch.from_numpy(out)

    def rows_D(self) -> torch.Tensor:
        """Rows each rank computes (long [D])."""
        D = self.tokens_ED.shape[1]
        rows = np.zeros(D, dtype=np.int64)
        single = self.holder_E >= 0
        np.add.at(rows, self.holder_E[single], self.tokens_ED[single].sum(1))
        np.add.at(rows, self.flows_4F[1], self.flows_4F[3])
        return torch.from_numpy(rows)

    def traffic_DD(self) -> torch.Tensor:
        """traffic[d, h]: tokens rank d sends to rank h over all experts (long [D, D], diagonal
        included: the tokens that stay)."""
        return torch.from_numpy(self.traffic_rows_DD().astype(np.int64))

    def traffic_rows_DD(self) -> np.ndarray:
        """:meth:`traffic_DD` as float64 (exact: integer sums below 2**53), what the exchange is
        priced on."""
        E, D = self.tokens_ED.shape
        if _fastplan is not None:  # the same sums in C
            out = np.empty((D, D))
            _fastplan.plan_traffic(*(np.ascontiguousarray(a, dtype=np.int64) for a in
                                     (self.holder_E, self.tokens_ED, self.flows_4F)), out, 1, E, D,
                                   self.flows_4F.shape[1], False)
            return out
        single = np.flatnonzero(self.holder_E >= 0)
        _, h, d, k = self.flows_4F
        index = np.concatenate([(np.arange(D)[None, :] * D + self.holder_E[single][:, None]).ravel(), d * D + h])
        counts = np.concatenate([self.tokens_ED[single].ravel(), k]).astype(np.int64)
        traffic = np.bincount(index, weights=counts, minlength=D * D)  # float64: exact below 2**53 tokens
        return np.rint(traffic).reshape(D, D)

    def moved(self, ranks_per_node: int) -> tuple[int, int]:
        """Tokens that change rank, over all experts: (within a node, between nodes); nodes are
        blocks of ``ranks_per_node`` ranks. (What traffic_DD off its diagonal sums to, by link,
        without the [D, D] table.)"""
        D, G = self.tokens_ED.shape[1], ranks_per_node
        single = np.flatnonzero(self.holder_E >= 0)
        h, i = self.holder_E[single], np.arange(single.size)
        T = self.tokens_ED[single]
        in_node = T.reshape(single.size, D // G, G).sum(2)[i, h // G]  # incl. staying
        stay = T[i, h]
        _, fh, fd, k = self.flows_4F
        same = fh // G == fd // G
        intra = int(in_node.sum() - stay.sum() + k[same & (fh != fd)].sum())
        inter = int(T.sum() - in_node.sum() + k[~same].sum())
        return intra, inter

    def dense(self) -> torch.Tensor:
        """plan_EDD (long [E, D, D])."""
        E, D = self.tokens_ED.shape
        plan = np.zeros((E, D, D), dtype=np.int64)
        single = np.flatnonzero(self.holder_E >= 0)
        plan[single, :, self.holder_E[single]] = self.tokens_ED[single]
        x, h, d, k = self.flows_4F
        plan[self.rep_X[x], d, h] = k
        return torch.from_numpy(plan)

    @classmethod
    def from_dense(cls, placement_ED: torch.Tensor, plan_EDD: torch.Tensor) -> "DispatchPlan":
        P = placement_ED.to("cpu", torch.bool).numpy()
        plan = plan_EDD.to("cpu", torch.long).numpy()
        holders = P.sum(1)
        holder_E = np.where(holders == 1, P.argmax(1), -1).astype(np.int64)
        rep_X = np.flatnonzero(holders > 1).astype(np.int64)
        rep_XDD = plan[rep_X]
        x, d, h = np.nonzero(rep_XDD)
        flows_4F = np.stack([x, h, d, rep_XDD[x, d, h]]).astype(np.int64)
        return cls(tokens_ED=plan.sum(2), holder_E=holder_E, rep_X=rep_X, flows_4F=flows_4F)

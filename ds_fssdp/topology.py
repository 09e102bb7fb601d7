"""Ranks grouped into nodes: real nodes from the launcher, or logical ones for one-machine tests.

Legend: D ranks, N nodes, G = ranks per node; the node of rank d is d // G.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Topology:
    num_ranks: int
    ranks_per_node: int

    def __post_init__(self):
        if self.num_ranks < 1:
            raise ValueError(f"Topology num_ranks ({self.num_ranks}) must be >= 1")
        if self.ranks_per_node < 1 or self.num_ranks % self.ranks_per_node:
            raise ValueError(f"Topology ranks_per_node ({self.ranks_per_node}) must divide num_ranks "
                             f"({self.num_ranks})")

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def node_D(self) -> torch.Tensor:
        """Node id of every rank, long [D]."""
        return torch.arange(self.num_ranks) // self.ranks_per_node

    def same_node_DD(self) -> torch.Tensor:
        """same_node_DD[d, d2]: ranks d and d2 share a node (bool [D, D])."""
        node_D = self.node_D()
        return node_D[:, None] == node_D[None, :]

"""Shard placements: which rank owns each expert (its parameters and optimizer states).

Legend: E experts, D ranks.
"""
from __future__ import annotations

import torch


def homogeneous_owner(num_experts: int, num_ranks: int) -> torch.Tensor:
    """Even sharding: contiguous blocks of experts per rank, ``owner_E[e] = e * D // E``.

    With E divisible by D every rank owns E / D consecutive experts (the expert-parallel layout);
    otherwise shard sizes differ by at most one, and with E < D some ranks own none.
    """
    return torch.arange(num_experts, dtype=torch.long) * num_ranks // num_experts


def shard_placement(owner_E: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """The shard placement P as a bool [E, D] matrix (one True per row)."""
    placement_ED = torch.zeros(owner_E.numel(), num_ranks, dtype=torch.bool)
    placement_ED[torch.arange(owner_E.numel()), owner_E] = True
    return placement_ED

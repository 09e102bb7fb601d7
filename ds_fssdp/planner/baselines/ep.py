"""Expert parallelism and its no-straggler reference.

Legend: E experts, D ranks.

``ep``: the homogeneous shard every iteration; nothing moves (the :class:`Policy` defaults).
``uniform``: EP behind a gate that spreads tokens evenly over the experts (paper section 5.1,
"Uniform"): each rank keeps its number of assignments and sends an equal share to every expert.
"""
from __future__ import annotations

import torch

from ds_fssdp.planner.baselines.base import Policy


class EPPolicy(Policy):
    name = "ep"


class UniformPolicy(Policy):
    name = "uniform"

    def route(self, tokens_ED: torch.Tensor) -> torch.Tensor:
        return uniform_tokens(tokens_ED)


def uniform_tokens(tokens_ED: torch.Tensor) -> torch.Tensor:
    """Rank d's assignments split evenly over the E experts; the remainder goes to the experts
    d, d + 1, ... (mod E), so remainders from different ranks land on different experts."""
    tokens_ED = tokens_ED.to("cpu", torch.long)
    E, D = tokens_ED.shape
    total_D = tokens_ED.sum(0)
    q_D, r_D = total_D // E, total_D % E
    shift_ED = torch.remainder(torch.arange(E)[:, None] - torch.arange(D)[None, :], E)
    return q_D[None, :] + (shift_ED < r_D[None, :]).long()

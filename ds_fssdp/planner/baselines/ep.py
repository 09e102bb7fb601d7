"""Expert parallelism and its no-straggler reference.

Legend: E experts, D ranks.

``ep``: the homogeneous shard every iteration; nothing moves (the :class:`Policy` defaults).
``uniform``: EP behind a gate that spreads tokens evenly over the experts (paper section 5.1,
"Uniform"): each rank keeps its number of assignments and sends an equal share to every expert.
"""
from __future__ import annotations

import numpy as np
import torch

from ds_fssdp.planner.baselines.base import Policy


class EPPolicy(Policy):
    name = "ep"


class UniformPolicy(Policy):
    name = "uniform"

    def route(self, tokens_ED: torch.Tensor) -> torch.Tensor:
        return uniform_tokens(tokens_ED)


def uniform_tokens(tokens_ED: torch.Tensor) -> torch.Tensor:
    """:func:`uniform_split` of one group's ``tokens_ED`` (long [E, D])."""
    return torch.from_numpy(uniform_split(tokens_ED.to("cpu", torch.long).numpy()))


def uniform_split(tokens_xEN: np.ndarray) -> np.ndarray:
    """The ``uniform`` routing's counts, the one remainder rule: rank d of a group (d numbered
    inside it) sends its assignment a to expert (a + d) mod E (``moe/gate.uniform_assignment``),
    so its n assignments split q = n // E to every expert and one more to the r = n mod E experts
    d, d + 1, ..., d + r - 1 (mod E): remainders from different ranks land on different experts.
    ``tokens_xEN``: [..., E, N] counts (any leading dims: layers, groups); int64 of the same shape."""
    tokens_xEN = np.asarray(tokens_xEN)
    E, N = tokens_xEN.shape[-2:]
    total_xN = tokens_xEN.sum(-2, dtype=np.int64)
    q_xN, r_xN = total_xN // E, total_xN % E
    shift_EN = (np.arange(E)[:, None] - np.arange(N)[None, :]) % E
    return q_xN[..., None, :] + (shift_EN < r_xN[..., None, :])

"""How one expert's weights are laid out: named 3-D tensors, or one flat row per expert.

Legend: E experts, S rows (experts held), H hidden, F expert FFN hidden, P elements per expert.

A row is the unit of the sparse collectives (one chunk per expert, Psi = P * element size) and of
the owner's optimizer state, so an expert's parameters, gradients and Adam moments move as rows.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from ds_fssdp.ops import ACTIVATIONS


class ExpertSpec:

    def __init__(self, activation: str, hidden_size: int, ffn_hidden_size: int):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation ({activation!r}) must be one of {tuple(ACTIVATIONS)}")
        self.activation = activation
        H, F = hidden_size, ffn_hidden_size
        self.shapes = {name: ((H, F) if side == "in" else (F, H)) for name, side in ACTIVATIONS[activation]}
        self.sizes = [math.prod(s) for s in self.shapes.values()]
        self.numel = sum(self.sizes)

    @property
    def names(self):
        return tuple(self.shapes)

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Named [S, *shape] tensors -> rows [S, P]."""
        return torch.cat([tensors[n].reshape(tensors[n].shape[0], -1) for n in self.names], dim=1)

    def views(self, rows_SP: torch.Tensor) -> dict:
        """rows [S, P] -> named [S, *shape] views (no copy; autograd flows back to the rows)."""
        parts = torch.split(rows_SP, self.sizes, dim=1)
        return {n: p.reshape(rows_SP.shape[0], *s) for (n, s), p in zip(self.shapes.items(), parts)}

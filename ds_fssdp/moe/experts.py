"""How one expert's weights are laid out: named tensors, or one flat row per expert.

Legend: E experts, S rows (experts held), H hidden, F expert FFN hidden, P elements per expert.

A row is the unit of the sparse collectives (one chunk per expert, Psi = P * element size) and of
the owner's optimizer state, so an expert's parameters, gradients and Adam moments move as rows.
The row holds the weights in the activation's order, then (``bias=True``) their biases: gated
activations add ``b_gate`` [F], ``b_up`` [F], ``b_down`` [H], the non-gated gelu ``b_a`` [F],
``b_b`` [H]. So biases move, reduce and step with their expert. Without biases the row is the
weights alone (the layout of every spec before biases existed).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from ds_fssdp.ops import activations
from ds_fssdp.planner.cost import ExpertShape


class ExpertSpec:

    def __init__(self, activation: str, hidden_size: int, ffn_hidden_size: int, *, bias: bool = False,
                 act_params: Optional[Mapping[str, float]] = None):
        self.act_params = activations.check(activation, act_params)
        self.activation = activation
        self.hidden_size, self.ffn_hidden_size, self.bias = hidden_size, ffn_hidden_size, bool(bias)
        H, F = hidden_size, ffn_hidden_size
        parts = list(activations.ACTIVATIONS[activation])
        self.shapes = {name: ((H, F) if side == "in" else (F, H)) for name, side in parts}
        if self.bias:
            self.shapes.update({name: ((F,) if side == "in" else (H,)) for name, side in activations.biases(activation)})
        self.sizes = [math.prod(s) for s in self.shapes.values()]
        self.numel = sum(self.sizes)

    @property
    def names(self):
        """Weights, then biases (if any), in row order."""
        return tuple(self.shapes)

    def cost_shape(self, param_bytes: int) -> ExpertShape:
        """This expert for the cost model: its weight matrices (biases are not matrices: they add
        elements to the row, not GEMMs) and its bias elements, at ``param_bytes`` per element."""
        matrices = len(activations.ACTIVATIONS[self.activation])
        return ExpertShape(hidden=self.hidden_size, ffn=self.ffn_hidden_size, matrices=matrices,
                           param_bytes=param_bytes, biases=self.numel - matrices * self.hidden_size * self.ffn_hidden_size)

    def describe(self) -> dict:
        """What rebuilds this spec (``ExpertSpec.from_description``), e.g. for checkpoint metadata."""
        return {"activation": self.activation, "hidden_size": self.hidden_size,
                "ffn_hidden_size": self.ffn_hidden_size, "bias": self.bias, "act_params": dict(self.act_params)}

    @classmethod
    def from_description(cls, d: Mapping) -> "ExpertSpec":
        """The inverse of ``describe``; ``bias`` and ``act_params`` may be absent (older metadata)."""
        return cls(d["activation"], d["hidden_size"], d["ffn_hidden_size"], bias=d.get("bias", False),
                   act_params=d.get("act_params"))

    def __repr__(self) -> str:
        return "ExpertSpec({activation!r}, {hidden_size}, {ffn_hidden_size}, bias={bias}, act_params={act_params})" \
            .format(**self.describe())

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Named [S, *shape] tensors -> rows [S, P]."""
        return torch.cat([tensors[n].reshape(tensors[n].shape[0], math.prod(tensors[n].shape[1:])) for n in self.names],
                         dim=1)  # no -1: also for 0 rows

    def views(self, rows_SP: torch.Tensor) -> dict:
        """rows [S, P] -> named [S, *shape] views (no copy; autograd flows back to the rows)."""
        parts = torch.split(rows_SP, self.sizes, dim=1)
        return {n: p.reshape(rows_SP.shape[0], *s) for (n, s), p in zip(self.shapes.items(), parts)}

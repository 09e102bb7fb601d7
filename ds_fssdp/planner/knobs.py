"""The "auto" knobs: overlap degree and materialization budget from measured quantities.

t = floor(T_attn * bw / Psi) (section 4.2): how many expert chunks the binding link can absorb
while the preceding attention computes. m: how many replicas fit the spare memory; with
re-materialization only one layer's replicas live at a time, so the whole budget serves each layer.
"""
from __future__ import annotations

import math


def auto_overlap_degree(*, attention_seconds: float, bandwidth: float, expert_bytes: int) -> int:
    if attention_seconds < 0 or bandwidth <= 0 or expert_bytes <= 0:
        raise ValueError(f"auto overlap degree needs attention_seconds >= 0 ({attention_seconds}), bandwidth > 0 "
                         f"({bandwidth}) and expert_bytes > 0 ({expert_bytes})")
    return int(math.floor(attention_seconds * bandwidth / expert_bytes))


def auto_materialization_budget(*, memory_bytes: int, expert_bytes: int, num_layers: int,
                                rematerialize: bool) -> int:
    """Replicas per rank per layer. A replica holds its parameters and, until the reduce, a
    gradient of the same size: 2 * Psi bytes. Without re-materialization every layer keeps its
    replicas through the iteration; with it, the layer computing and the next one, whose gather
    starts during that compute (replicas on the idle link): two layers live across it."""
    if memory_bytes < 0 or expert_bytes <= 0 or num_layers < 1:
        raise ValueError(f"auto budget needs memory_bytes >= 0 ({memory_bytes}), expert_bytes > 0 ({expert_bytes}) "
                         f"and num_layers >= 1 ({num_layers})")
    per_replica = 2 * expert_bytes
    layers_resident = min(2, num_layers) if rematerialize else num_layers
    return memory_bytes // (per_replica * layers_resident)

"""The "auto" knobs: overlap degree and materialization budget from measured quantities.

t = floor(T_attn * bw / Psi) (section 4.2): how many expert chunks the binding link can absorb
while the preceding attention computes. m: how many replicas fit the spare memory; with
re-materialization only one layer's replicas live at a time, so the whole budget serves each layer.
"""
from __future__ import annotations

import math

from ds_fssdp.planner.prices import replica_bytes


def auto_overlap_degree(*, attention_seconds: float, bandwidth: float, expert_bytes: int) -> int:
    if attention_seconds < 0 or bandwidth <= 0 or expert_bytes <= 0:
        raise ValueError(f"auto overlap degree needs attention_seconds >= 0 ({attention_seconds}), bandwidth > 0 "
                         f"({bandwidth}) and expert_bytes > 0 ({expert_bytes})")
    return int(math.floor(attention_seconds * bandwidth / expert_bytes))


def auto_materialization_budget(*, memory_bytes: int, expert_bytes: int, num_layers: int,
                                rematerialize: bool, in_flight: int = 1) -> int:
    """Replicas per rank per layer. A replica holds :func:`~ds_fssdp.planner.prices.replica_bytes`
    (2 Psi). Without re-materialization every layer keeps its
    replicas through the iteration; with it, the layer computing and the next one, whose gather
    starts during that compute (replicas on the idle link): two layers live across it.
    ``in_flight``: micro-batches whose forward is done and backward pending at once (a pipeline
    stage s of S under 1F1B: min(G, S - s)); each keeps every layer's replicas, or under
    re-materialization its last layer's, until its backward."""
    if memory_bytes < 0 or expert_bytes <= 0 or num_layers < 1 or in_flight < 1:
        raise ValueError(f"auto budget needs memory_bytes >= 0 ({memory_bytes}), expert_bytes > 0 ({expert_bytes}), "
                         f"num_layers >= 1 ({num_layers}) and in_flight >= 1 ({in_flight})")
    per_replica = int(replica_bytes(expert_bytes))
    return memory_bytes // (per_replica * resident_layers(num_layers, rematerialize=rematerialize, in_flight=in_flight))


def resident_layers(num_layers: int, *, rematerialize: bool, in_flight: int = 1) -> int:
    """Layers' worth of replicas alive at the peak (:func:`auto_materialization_budget`)."""
    if rematerialize:
        return min(2, num_layers) + (in_flight - 1) * (1 if num_layers > 1 else 0)
    return num_layers * in_flight

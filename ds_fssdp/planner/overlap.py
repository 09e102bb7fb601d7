"""t and placement by time: how many distinct experts a layer's pre-gating gather replicates, and
which materializer places them, from the modelled layer time rather than from what fits the window
alone.

Legend: E experts, D ranks.

The window's t (:meth:`~ds_fssdp.planner.cost.CostModel.overlap_degree` of the seconds the schedule
leaves before the layer) is the most a gather hides. A larger t exposes part of the gather but can
balance the compute enough to pay for it (a small expert, a skewed load); a big expert's exposed
gather costs more than it balances. So t is searched: the window's t, then doubled up to E, each
candidate's placement priced as its modelled layer time (``cost.layer_time`` of its dispatch of
the predicted ``tokens_ED``: the exchange as it runs, :mod:`ds_fssdp.planner.scheduled`, for the
runtime, the replay and the simulators alike) plus the gather and reduce the windows do not hide
(:func:`~ds_fssdp.planner.cost.exposed_transfer`: the gather past the clock's window, the reduce
past the attention backward and the idle link the layer's backward leaves, what the simulators
charge, :func:`~ds_fssdp.planner.scheduled.reduce_window_s`), and the search stops at the first candidate that
is not faster (or adds no replica: the memory budget is full). The window's t is always a
candidate, so a layer never prices worse than without the search.

Placement by time (:func:`choose_placement`): the same search runs over each family of placements
the policy offers (its configured one first; with per-rank predictions, also the joint placement
that fills every slot the t allows, ``joint_materialize(stop=0)``: replicas where the tokens come
from, so a hot expert's tokens stay in the nodes that produce them), and the least modelled time
wins; ties keep the earlier family. So the configured placement is always a candidate and a layer
never prices worse than with it alone.

Pure: the runtime, the simulator and the report's replay reach it through
``FSSDPPolicy.pre_gating`` with the same inputs (the owners, the predicted ``tokens_ED`` and the
clock's window), so they take the same t.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ds_fssdp.planner.cost import CostModel, exposed_transfer


@dataclass(frozen=True)
class OverlapChoice:
    overlap_degree: int  # t taken
    placement_ED: torch.Tensor  # its pre-gating placement
    modelled_s: float  # its modelled layer time with the exposed gather and reduce
    window_t: int  # the window's t (the first candidate)
    tried: int  # candidates priced
    family: str = ""  # the placement family it came from (choose_placement)
    credit_s: float = 0.0  # the calibration credit its search took off (Clock.calibration_credit_s)


def layer_seconds(cost: CostModel, owner_E: torch.Tensor, placement_ED: torch.Tensor, tokens_ED: torch.Tensor, *,
                  plan_of: Callable, window_s: float, rematerialize: bool, attention_s: float | None = None) -> float:
    """Modelled forward + backward of the MoE part of a layer under ``placement_ED``: the
    exchanges and the slowest rank's compute of the dispatch of ``tokens_ED`` (``plan_of(placement_ED,
    tokens_ED)``, the policy's compact plan; ``cost.layer_price``), plus the gather past
    ``window_s`` and the reduce past the backward's window: the attention backward (twice
    ``attention_s``) and the link the layer's backward exchange leaves free, where the cost model
    prices the schedule (else, or without ``attention_s``, twice ``window_s``)."""
    layer_s, window_b = cost.layer_price(plan_of(placement_ED, tokens_ED), attention_s)
    return layer_s + exposed_transfer(cost.gather_time(owner_E, placement_ED), window_s, rematerialize=rematerialize,
                                      backward_window_s=window_b)


def choose_overlap_degree(place_at: Callable[[int], torch.Tensor], seconds_of: Callable[[torch.Tensor], float], *,
                          window_t: int, max_t: int) -> OverlapChoice:
    """The t in (window_t, 2 window_t, 4 window_t, ..., max_t) whose placement ``place_at(t)`` has the
    least ``seconds_of``; the doubling stops at the first that is not faster or adds nothing. Ties
    keep the smaller t (fewer bytes moved). ``window_t`` 0 tries 1 next."""
    if window_t < 0 or max_t < 0:
        raise ValueError(f"choose_overlap_degree: window_t ({window_t}) and max_t ({max_t}) must be >= 0")
    t = first = min(window_t, max_t)
    best_ED = place_at(t)
    best_t, best_s, tried = t, seconds_of(best_ED), 1
    while t < max_t:
        t = min(max_t, max(1, 2 * t))
        placement_ED = place_at(t)
        if torch.equal(placement_ED, best_ED):
            break
        tried += 1
        s = seconds_of(placement_ED)
        if not s < best_s:
            break
        best_t, best_ED, best_s = t, placement_ED, s
    return OverlapChoice(best_t, best_ED, best_s, first, tried)


def choose_placement(families: dict, seconds_of: Callable[[torch.Tensor], float], *, window_t: int,
                     max_t: int) -> OverlapChoice:
    """:func:`choose_overlap_degree` over each family (name -> ``place_at(t)``, in order); the
    least ``seconds_of`` wins, ties keep the earlier family. ``tried`` counts every candidate."""
    if not families:
        raise ValueError("choose_placement: no placement family to search")
    best, tried = None, 0
    for name, place_at in families.items():
        choice = choose_overlap_degree(place_at, seconds_of, window_t=window_t, max_t=max_t)
        tried += choice.tried
        if best is None or choice.modelled_s < best.modelled_s:
            best = dataclasses.replace(choice, family=name)
    return dataclasses.replace(best, tried=tried)

"""The planner's one entry point for a layer's pre-gating placement: what the runtime gathers.

Legend: E experts, D ranks.

``place(owner_E, tokens_ED, topology, config=..., cost=...)`` is called by the runtime
(``ShardedExperts.plan_placement``), the report's replay and the simulator's FSSDP policy, so the
three agree by construction. ``config`` is the validated ``"fssdp"`` section or any object with
its field names (``placement``, ``overlap_degree``, and ``materialization_budget`` or ``budget``;
``policy`` optional, default ``"fssdp"``) holding resolved ints, not ``"auto"``.

* ``tokens_ED`` None (no load history yet), policy ``ep`` or a baseline that gathers nothing
  before gating: the shard alone.
* ``placement "paper"``, or per-expert loads only (``tokens_ED`` of shape [E]): Algorithm 1
  (``materialize``).
* ``"joint"``: ``joint_materialize`` (replicas where the tokens come from, every useful slot).
* ``"cost"``: ``cost_materialize`` with ``cost`` (a ``CostModel``): the fewest replicas that level
  the predicted loads, at the level of least modelled layer time, a replica's gather and reduce
  counted where ``cost.overlap_window(t)`` does not hide them. Without a cost model it is
  ``"joint"`` (there is no exchange rate between rows and bytes to weigh). ``margin``: the
  prediction's expected relative error, the headroom each level keeps (``cost_place.MARGIN`` when
  None); :func:`place_predicted` passes the predictor's measured error (``LoadPredictor.error``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_fssdp.planner.cost_place import MARGIN, MAX_MARGIN, Coefficients, cost_materialize
from ds_fssdp.planner.joint import joint_materialize
from ds_fssdp.planner.materialize import materialize
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.topology import Topology

PLACEMENTS = ("cost", "joint", "paper")
_GATHERING = ("fssdp", "ep")  # policies whose placement is planned before gating


@dataclass(frozen=True)
class PlacementOptions:
    """The fields of the ``"fssdp"`` section :func:`place` reads, with resolved ints."""

    placement: str = "joint"
    overlap_degree: int = 4
    materialization_budget: int = 2
    policy: str = "fssdp"


def place(owner_E: torch.Tensor, tokens_ED: torch.Tensor | None, topology: Topology, *, config,
          cost=None, margin: float | None = None) -> torch.Tensor:
    """placement_ED (bool [E, D]): the shard plus this iteration's replicas."""
    policy = getattr(config, "policy", "fssdp")
    placement = config.placement
    if placement not in PLACEMENTS:
        raise ValueError(f"placement ({placement!r}) must be one of {PLACEMENTS}")
    t = config.overlap_degree
    m = getattr(config, "materialization_budget", None)
    m = config.budget if m is None else m
    for key, value in (("overlap_degree", t), ("materialization_budget", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"place: {key} ({value!r}) must be a resolved int >= 0")
    owner_E = owner_E.to("cpu", torch.long)
    if policy not in _GATHERING or policy == "ep" or tokens_ED is None:
        return shard_placement(owner_E, topology.num_ranks)
    if placement == "paper" or tokens_ED.dim() == 1:
        load_E = tokens_ED if tokens_ED.dim() == 1 else tokens_ED.sum(1)
        return materialize(owner_E, load_E, topology, overlap_degree=t, budget=m)
    if placement == "cost" and cost is not None:
        margin = MARGIN if margin is None else min(float(margin), MAX_MARGIN)
        if not margin >= 0.0:
            raise ValueError(f"place: margin ({margin!r}) must be >= 0")
        return cost_materialize(owner_E, tokens_ED, topology, overlap_degree=t, budget=m,
                                coefficients=coefficients_of(cost, t), margin=margin)
    return joint_materialize(owner_E, tokens_ED, topology, overlap_degree=t, budget=m)


def place_predicted(predictor, layer: int, owner_E: torch.Tensor, topology: Topology, *, config,
                    cost=None) -> torch.Tensor:
    """:func:`place` on ``predictor``'s prediction for ``layer``: its ``tokens_ED`` when it has
    per-rank history, else its per-expert loads (None before any observation), with its measured
    error as the margin."""
    tokens_ED = predictor.predict_tokens(layer)
    if tokens_ED is None:
        tokens_ED = predictor.predict(layer)
    return place(owner_E, tokens_ED, topology, config=config, cost=cost, margin=predictor.error(layer))


def coefficients_of(cost, overlap_degree: int) -> Coefficients:
    """The cost model's :class:`Coefficients` for overlap degree t, computed once per (model, t)
    (cached on the model)."""
    cache = cost.__dict__.setdefault("_place_coefficients", {})
    c = cache.get(overlap_degree)
    if c is None:
        c = cache[overlap_degree] = Coefficients.from_cost(cost, overlap_degree)
    return c

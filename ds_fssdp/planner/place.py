"""The planner's one entry point for a layer's pre-gating placement: what the runtime gathers.

Legend: E experts, D ranks.

``place(owner_E, tokens_ED, topology, config=...)`` is called by ``FSSDPPolicy.pre_gating``, which
the runtime, the simulators and the report's replay reach through ``LayerPlanner``, so they agree
by construction. ``config`` is the validated ``"fssdp"`` section or any object with
its field names (``placement``, ``overlap_degree``, and ``materialization_budget`` or ``budget``;
``policy`` optional, default ``"fssdp"``) holding resolved ints, not ``"auto"``.

* ``tokens_ED`` None (no load history yet), policy ``ep`` or a baseline that gathers nothing
  before gating: the shard alone.
* ``placement "paper"``, or per-expert loads only (``tokens_ED`` of shape [E]): Algorithm 1
  (``materialize``).
* ``"joint"``: ``joint_materialize`` (replicas where the tokens come from, every useful slot).

``"cost"`` (replicate only what pays, on the cost model) was removed: it won on no cluster and no
CPU run (``benchmarks/results/README.md``); the configuration refuses it by name.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_fssdp.planner.joint import joint_materialize
from ds_fssdp.planner.materialize import materialize
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.topology import Topology

PLACEMENTS = ("joint", "paper")
_GATHERING = ("fssdp", "ep")  # policies whose placement is planned before gating


@dataclass(frozen=True)
class PlacementOptions:
    """The fields of the ``"fssdp"`` section :func:`place` reads, with resolved ints."""

    placement: str = "paper"
    overlap_degree: int = 4
    materialization_budget: int = 2
    policy: str = "fssdp"


def place(owner_E: torch.Tensor, tokens_ED: torch.Tensor | None, topology: Topology, *, config) -> torch.Tensor:
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
    return joint_materialize(owner_E, tokens_ED, topology, overlap_degree=t, budget=m)

"""The planner's one entry point for a layer's pre-gating placement: what the runtime gathers.

Legend: E experts, D ranks.

``place(owner_E, tokens_ED, topology, placement=..., overlap_degree=t, budget=m)`` is called by
``FSSDPPolicy.pre_gating``, which the runtime, the simulators and the report's replay reach through
``LayerPlanner``, so they agree by construction.

* ``tokens_ED`` None (no load history yet): the shard alone.
* ``placement "paper"``, or per-expert loads only (``tokens_ED`` of shape [E]): Algorithm 1
  (``materialize``).
* ``"joint"``: ``joint_materialize`` (replicas where the tokens come from, every useful slot).
"""
from __future__ import annotations

import torch

from ds_fssdp.planner.joint import joint_materialize
from ds_fssdp.planner.materialize import materialize
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.topology import Topology

PLACEMENTS = ("joint", "paper")


def place(owner_E: torch.Tensor, tokens_ED: torch.Tensor | None, topology: Topology, *, placement: str,
          overlap_degree: int, budget: int) -> torch.Tensor:
    """placement_ED (bool [E, D]): the shard plus this iteration's replicas (t = ``overlap_degree``,
    m = ``budget``: resolved ints, not "auto")."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement ({placement!r}) must be one of {PLACEMENTS}")
    for key, value in (("overlap_degree", overlap_degree), ("materialization_budget", budget)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"place: {key} ({value!r}) must be a resolved int >= 0")
    owner_E = owner_E.to("cpu", torch.long)
    if tokens_ED is None:
        return shard_placement(owner_E, topology.num_ranks)
    if placement == "paper" or tokens_ED.dim() == 1:
        load_E = tokens_ED if tokens_ED.dim() == 1 else tokens_ED.sum(1)
        return materialize(owner_E, load_E, topology, overlap_degree=overlap_degree, budget=budget)
    return joint_materialize(owner_E, tokens_ED, topology, overlap_degree=overlap_degree, budget=budget)

"""Placement policies: one interface from predicted loads to this iteration's placement.

``fssdp``: Algorithm 1 on the predicted loads (the shard alone until there is a load history).
``ep``: static expert parallelism, the shard placement every iteration (no replicas).
"""
from __future__ import annotations

import torch

from ds_fssdp.planner.materialize import materialize
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.topology import Topology

POLICIES = ("fssdp", "ep")


def plan_placement(policy: str, owner_E: torch.Tensor, load_E: torch.Tensor | None, topology: Topology, *,
                   overlap_degree: int, budget: int) -> torch.Tensor:
    if policy not in POLICIES:
        raise ValueError(f"policy ({policy!r}) must be one of {POLICIES}")
    if policy == "ep" or load_E is None:
        return shard_placement(owner_E, topology.num_ranks)
    return materialize(owner_E, load_E, topology, overlap_degree=overlap_degree, budget=budget)

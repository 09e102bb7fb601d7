"""Calibration (paper section 4.2): after gating, with the actual loads, add replicas if worth it.

Legend: E experts, D ranks.

The placement gathered during the preceding attention came from predicted loads. With the actual
``tokens_ED`` known, Algorithm 1 runs again on the budget left and the result is merged into the
placement. The merged placement is adopted only if the modelled latency it saves exceeds the
modelled cost of the extra gather (which now sits on the critical path) and that cost fits the
latency budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ds_fssdp.planner.cost import CostModel
from ds_fssdp.planner.dispatch import dispatch
from ds_fssdp.planner.materialize import materialize
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.topology import Topology


@dataclass(frozen=True)
class Calibration:
    placement_ED: torch.Tensor  # the placement to use (merged if accepted, else the input)
    accepted: bool
    added_pairs: int  # replicas the merge adds (0 when rejected)
    saved_s: float  # modelled layer time saved by the merge
    extra_s: float  # modelled time of the extra gather


def calibrate(owner_E: torch.Tensor, placement_ED: torch.Tensor, tokens_ED: torch.Tensor, topology: Topology,
              cost: CostModel, *, overlap_degree: int, budget: int, latency_budget: float,
              dispatcher: Callable = dispatch) -> Calibration:
    merged_ED = materialize(owner_E, tokens_ED.sum(1), topology, overlap_degree=overlap_degree, budget=budget,
                            base_ED=placement_ED)
    new_ED = merged_ED & ~placement_ED
    if not bool(new_ED.any()):
        return Calibration(placement_ED, False, 0, 0.0, 0.0)
    before = cost.layer_time(dispatcher(placement_ED, tokens_ED, topology))
    after = cost.layer_time(dispatcher(merged_ED, tokens_ED, topology))
    extra = cost.gather_time(owner_E, shard_placement(owner_E, topology.num_ranks) | new_ED)
    saved = before - after
    if saved > extra and extra <= latency_budget:
        return Calibration(merged_ED, True, int(new_ED.sum()), saved, extra)
    return Calibration(placement_ED, False, 0, saved, extra)

"""Pure, deterministic planning: no torch.distributed, no GPU. Same inputs, same plan on every rank."""
from ds_fssdp.planner.baselines import (POLICY_NAMES, Clock, LayerPlan, Policy, PolicyConfig, Reshard, make_policy)
from ds_fssdp.planner.calibrate import Calibration, calibrate
from ds_fssdp.planner.cost import CostModel, ExpertShape, Hardware
from ds_fssdp.planner.dispatch import dispatch, rows_per_rank, straggler_factor
from ds_fssdp.planner.knobs import auto_materialization_budget, auto_overlap_degree
from ds_fssdp.planner.materialize import materialize
from ds_fssdp.planner.place import PLACEMENTS, place
from ds_fssdp.planner.predict import LoadPredictor
from ds_fssdp.planner.shard import heterogeneous_sharding, homogeneous_owner, initial_ownership, shard_placement
from ds_fssdp.planner.transfers import GatherLayout, gather_layout

__all__ = [
    "Calibration", "calibrate", "CostModel", "ExpertShape", "Hardware", "dispatch", "rows_per_rank",
    "straggler_factor", "auto_materialization_budget", "auto_overlap_degree", "materialize", "place", "PLACEMENTS",
    "LoadPredictor", "heterogeneous_sharding", "homogeneous_owner", "initial_ownership", "shard_placement",
    "GatherLayout", "gather_layout", "POLICY_NAMES", "Clock", "LayerPlan", "Policy", "PolicyConfig", "Reshard", "make_policy"
]

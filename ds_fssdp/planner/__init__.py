"""Pure, deterministic planning: no torch.distributed, no GPU. Same inputs, same plan on every rank."""
from ds_fssdp.planner.dispatch import dispatch, rows_per_rank, straggler_factor
from ds_fssdp.planner.materialize import materialize
from ds_fssdp.planner.policies import POLICIES, plan_placement
from ds_fssdp.planner.predict import LoadPredictor
from ds_fssdp.planner.shard import homogeneous_owner, shard_placement
from ds_fssdp.planner.transfers import GatherLayout, gather_layout

__all__ = [
    "dispatch", "rows_per_rank", "straggler_factor", "materialize", "POLICIES", "plan_placement", "LoadPredictor",
    "homogeneous_owner", "shard_placement", "GatherLayout", "gather_layout"
]

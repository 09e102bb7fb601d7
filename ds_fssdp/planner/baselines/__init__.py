"""Placement policies behind one interface (see :mod:`.base` for the phases and their order).

    policy = make_policy("smartmoe", PolicyConfig(num_experts=64, num_layers=12, topology=topo))

``ep``, ``uniform`` (:mod:`.ep`), ``fastermoe``, ``smartmoe``, ``flexmoe`` (one file each),
``fssdp`` and ``fssdp-rm`` (:mod:`.fssdp`).
"""
from ds_fssdp.planner.baselines.base import Clock, Dispatcher, LayerPlan, Materializer, Policy, PolicyConfig, Reshard
from ds_fssdp.planner.baselines.ep import EPPolicy, UniformPolicy, uniform_tokens
from ds_fssdp.planner.baselines.fastermoe import FasterMoEPolicy
from ds_fssdp.planner.baselines.flexmoe import FlexMoEPolicy, balance_ratio
from ds_fssdp.planner.baselines.fssdp import FSSDPPolicy, FSSDPRematerializePolicy
from ds_fssdp.planner.baselines.relabel import moved_copies, relabel_owner
from ds_fssdp.planner.baselines.smartmoe import SmartMoEPolicy, lpt_with_slots
from ds_fssdp.planner.materialize import materialize as _algorithm1

POLICY_CLASSES = {
    cls.name: cls
    for cls in (EPPolicy, UniformPolicy, FasterMoEPolicy, SmartMoEPolicy, FlexMoEPolicy, FSSDPPolicy,
                FSSDPRematerializePolicy)
}
POLICY_NAMES = tuple(POLICY_CLASSES)


def make_policy(name: str, config: PolicyConfig, *, dispatcher: Dispatcher | None = None,
                materializer: Materializer = _algorithm1) -> Policy:
    """A fresh policy object (policies may keep state across iterations: one per training run)."""
    if name not in POLICY_CLASSES:
        raise ValueError(f"policy ({name!r}) must be one of {POLICY_NAMES}")
    return POLICY_CLASSES[name](config, dispatcher=dispatcher, materializer=materializer)


__all__ = [
    "Clock", "Dispatcher", "LayerPlan", "Materializer", "Policy", "PolicyConfig", "Reshard", "EPPolicy", "UniformPolicy",
    "uniform_tokens", "FasterMoEPolicy", "FlexMoEPolicy", "balance_ratio", "FSSDPPolicy", "FSSDPRematerializePolicy",
    "moved_copies", "relabel_owner", "SmartMoEPolicy", "lpt_with_slots", "POLICY_CLASSES", "POLICY_NAMES", "make_policy"
]

"""One MoE layer's decisions for one iteration, in the runtime's order: pure, no communication.

Legend: E experts, D ranks.

The runtime (``moe/sharded.py``), the simulator and the report's replay drive every layer
through a :class:`LayerPlanner`, so they make the same decisions from the same inputs; only the
:class:`~ds_fssdp.planner.baselines.Clock` (t and calibration's latency budget) comes from their
own clocks.

1. :meth:`pre_gating_t` before the preceding attention: the placement from the predictor's
   prediction (its per-rank ``tokens_ED`` when it has them, else its per-expert loads), with the
   clock's ``calibration_credit_s`` set from calibration's realized savings on this layer (the
   mean over its last load-window observed iterations whose placement left calibration room);
2. :meth:`post_gating` once the actual ``tokens_ED`` are known: calibration or shadowing, from
   the t pre-gating planned with;
3. :meth:`dispatch`: the compact dispatch plan;
4. :meth:`observe`: the predictor learns the loads (once per training forward).
"""
from __future__ import annotations

import collections
import dataclasses

import torch

from ds_fssdp.planner.baselines.base import Clock, LayerPlan, Policy
from ds_fssdp.planner.baselines.fssdp import FSSDPPolicy
from ds_fssdp.planner.calibrate import leaves_room
from ds_fssdp.planner.plan import DispatchPlan
from ds_fssdp.planner.predict import LoadPredictor


class LayerPlanner:

    def __init__(self, policy: Policy, predictor: LoadPredictor, layer: int):
        self.policy = policy
        self.predictor = predictor
        self.layer = layer
        # calibration's realized net savings on placements that left it room, the last w training
        # forwards' (committed by observe: an evaluation forward plans but is not observed)
        self._credits = collections.deque(maxlen=max(1, predictor.window))
        self._credit = None

    def pre_gating_t(self, owner_E: torch.Tensor, clock: Clock | None = None) -> tuple:
        """``(placement_ED, t)``: the shard plus the replicas gathered under the attention (bool
        [E, D]), with the overlap degree it was planned with (FSSDP's t, searched by the modelled
        time when the policy does; -1: a policy without one)."""
        predicted = self.predictor.predict_tokens(self.layer)
        if predicted is None:
            predicted = self.predictor.predict(self.layer)
        if clock is not None and self._credits:
            clock = dataclasses.replace(clock, calibration_credit_s=sum(self._credits) / len(self._credits))
        return self.policy.pre_gating_t(self.layer, owner_E, predicted, clock=clock)

    def post_gating(self, owner_E: torch.Tensor, placement_ED: torch.Tensor, tokens_ED: torch.Tensor,
                    clock: Clock | None = None, *, overlap_t: int = -1) -> LayerPlan:
        """``overlap_t``: the t :meth:`pre_gating_t` planned ``placement_ED`` with; calibration
        builds on it (the clock's t is the window's, which a t searched by time exceeds)."""
        if clock is not None and overlap_t >= 0:
            clock = dataclasses.replace(clock, overlap_degree=overlap_t)
        plan = self.policy.post_gating(self.layer, owner_E, placement_ED, tokens_ED=tokens_ED, clock=clock)
        cal = plan.calibration
        self._credit = None
        if cal is not None and leaves_room(placement_ED, self.policy.config.budget):
            self._credit = max(0.0, cal.saved_s - cal.extra_s) if cal.accepted else 0.0
        return plan

    def dispatch(self, layer_plan: LayerPlan, tokens_ED: torch.Tensor) -> DispatchPlan:
        return self.policy.dispatch_plan(layer_plan, tokens_ED)

    def observe(self, tokens_ED: torch.Tensor) -> float:
        """Feed the actual loads to the predictor (and calibration's realized saving on this
        iteration's placement, when it left calibration room, to the credit :meth:`pre_gating_t`
        hands the search); returns the error of its last prediction."""
        if self._credit is not None:
            self._credits.append(self._credit)
            self._credit = None
        return self.predictor.observe(self.layer, tokens_ED)


def migrations(policies: list, step: int, load_LE: torch.Tensor | None, owner_LE: torch.Tensor, *,
               clock: Clock | None = None) -> list:
    """The re-shards of one step, in order (the runtime's after its optimizer step, the replay's
    and the simulators' before the iteration): each policy's :meth:`~Policy.reshard` from the
    owners the previous one left. ``policies``: Algorithm 2's (``reshard_interval``) first, then the
    policy's own (SmartMoE's permutation), as :func:`migrating_policies` lists them. Returns the
    :class:`~ds_fssdp.planner.baselines.Reshard` of every one that moved something."""
    done = []
    for policy in policies:
        r = policy.reshard(step, load_LE, owner_LE=owner_LE, clock=clock)
        if r is not None:
            done.append(r)
            owner_LE = r.owner_LE
    return done


def migrating_policies(policy: Policy, *, reshard_interval: int) -> list:
    """Who re-shards: FSSDP's Algorithm 2 every ``reshard_interval`` steps (the policy itself for
    FSSDP, a companion FSSDP policy with the same config for the others), then the policy's own
    (SmartMoE's permutation); a policy with neither: none."""
    out = []
    if reshard_interval and not isinstance(policy, FSSDPPolicy):
        out.append(FSSDPPolicy(policy.config))
    if isinstance(policy, FSSDPPolicy) or type(policy).reshard is not Policy.reshard:
        out.append(policy)
    return out

"""FSSDP (Themis) as a policy: ephemeral replicas every iteration, re-sharding every few hundred.

Legend: L layers, E experts, D ranks.

* reshard: Algorithm 2 (heterogeneous sharding) on the predicted loads of all layers every
  ``reshard_interval`` iterations (not at step 0: layers start homogeneous, section 4.3). Ranks are
  renamed (nodes permuted, ranks permuted inside nodes, which Algorithm 2 cannot tell apart) to
  keep as many experts as possible in place; the ones that move carry their optimizer state.
* pre_gating: ``planner.place`` (Algorithm 1 on the predicted loads by default, or the config's
  ``placement``), gathered under the preceding attention.
* post_gating: calibration (optional) with the actual loads and the budget left; it may add
  replicas of experts beyond the top-t, as many distinct ones as the binding link absorbs within
  ``calibration_latency_budget`` (its gather is on the critical path), fewer when that merge's
  gather does not fit, and where the budget is full it may evict pre-gated replicas the actual
  loads do not need (``planner.calibrate``).
* ``fssdp-rm``: the same with re-materialization: replicas are freed after the forward and
  gathered again before the backward. The caller gives it the larger per-layer budget
  (:func:`ds_fssdp.planner.knobs.auto_materialization_budget` with ``rematerialize=True``).
"""
from __future__ import annotations

import dataclasses

import torch

from ds_fssdp.planner.baselines.base import Clock, LayerPlan, Policy, Reshard
from ds_fssdp.planner.baselines.relabel import moved_copies, relabel_owner
from ds_fssdp.planner.calibrate import Calibration, calibrate, leaves_room
from ds_fssdp.planner.materialize import materialize as algorithm1_materialize
from ds_fssdp.planner.joint import joint_materialize
from ds_fssdp.planner.overlap import OverlapChoice, choose_placement, layer_seconds
from ds_fssdp.planner.place import place
from ds_fssdp.planner.shard import heterogeneous_sharding, shard_placement


class FSSDPPolicy(Policy):
    name = "fssdp"

    def reshard(self, step: int, history_load_LE: torch.Tensor | None, *, owner_LE: torch.Tensor,
                clock: Clock | None = None) -> Reshard | None:
        interval = self.config.reshard_interval
        if history_load_LE is None or interval == 0 or step == 0 or step % interval:
            return None
        new_LE = heterogeneous_sharding(history_load_LE, self.topology, overlap_degree=self.overlap_degree(clock))
        new_LE = relabel_owner(owner_LE, new_LE, self.topology, keep_nodes=True)
        return Reshard(owner_LE=new_LE, copies_M4=moved_copies(owner_LE, new_LE))

    def pre_gating(self, layer: int, owner_E: torch.Tensor, predicted_load_E: torch.Tensor | None, *,
                   clock: Clock | None = None) -> torch.Tensor:
        """``predicted_load_E``: per-expert loads [E], or the predicted ``tokens_ED`` [E, D] (what
        placement "joint" needs). :func:`~ds_fssdp.planner.place`, unless another materializer was
        injected (placement "paper" then uses it on the loads); t by the modelled time when
        :meth:`by_time`."""
        return self.pre_gating_t(layer, owner_E, predicted_load_E, clock=clock)[0]

    def pre_gating_t(self, layer: int, owner_E: torch.Tensor, predicted_load_E: torch.Tensor | None, *,
                     clock: Clock | None = None) -> tuple:
        t = self.overlap_degree(clock)
        if predicted_load_E is None:
            return shard_placement(owner_E.to("cpu", torch.long), self.topology.num_ranks), t
        if self.by_time(clock):
            choice = self.overlap_choice(owner_E, predicted_load_E, clock)
            return choice.placement_ED, choice.overlap_degree
        return self._place(owner_E, predicted_load_E, t), t

    def _place(self, owner_E: torch.Tensor, predicted_load_E: torch.Tensor, t: int) -> torch.Tensor:
        if self.materializer is not algorithm1_materialize and self.config.placement == "paper":
            load_E = predicted_load_E if predicted_load_E.dim() == 1 else predicted_load_E.sum(1)
            return self.materializer(owner_E, load_E, self.topology, overlap_degree=t, budget=self.config.budget)
        return place(owner_E, predicted_load_E, self.topology, placement=self.config.placement, overlap_degree=t,
                     budget=self.config.budget)

    def by_time(self, clock: Clock | None) -> bool:
        """Whether t is searched by the modelled time (:mod:`ds_fssdp.planner.overlap`): configured,
        with a cost model and a clock that knows its window."""
        return (self.config.overlap_by_time and self.config.cost is not None and clock is not None
                and clock.window_s is not None)

    def overlap_choice(self, owner_E: torch.Tensor, predicted_load_E: torch.Tensor, clock: Clock) -> OverlapChoice:
        """t and its placement by the modelled layer time on the predicted tokens (per-rank when the
        predictor has them, else each expert's load spread evenly over the ranks): the configured
        placement's search, and with per-rank predictions the joint placement's that fills every
        slot (:func:`~ds_fssdp.planner.overlap.choose_placement`). With calibration, a candidate
        that leaves it room is priced less the clock's ``calibration_credit_s`` (what calibration
        realized on this layer lately: the actual loads differ from the predicted ones, on which
        calibration has nothing to fix); the choice's ``modelled_s`` is its price without it."""
        cfg, topo = self.config, self.topology
        owner_E = owner_E.to("cpu", torch.long)
        tokens_ED = predicted_load_E.to("cpu", torch.float64)
        if tokens_ED.dim() == 1:
            tokens_ED = tokens_ED[:, None].expand(-1, topo.num_ranks) / topo.num_ranks
        tokens_ED = tokens_ED.round().long()
        # placement "paper" places by the per-expert loads: summed once for every t
        paper = cfg.placement == "paper" and predicted_load_E.dim() == 2
        place_loads = predicted_load_E.sum(1) if paper else predicted_load_E
        families = {cfg.placement: lambda t: self._place(owner_E, place_loads, t)}
        if predicted_load_E.dim() == 2:
            families["joint-fill"] = lambda t: joint_materialize(owner_E, predicted_load_E, topo, overlap_degree=t,
                                                                 budget=cfg.budget, stop=0.0)
        credit = float(clock.calibration_credit_s) if cfg.calibration else 0.0

        def credit_of(placement_ED) -> float:
            return credit if credit > 0.0 and leaves_room(placement_ED, cfg.budget) else 0.0

        choice = choose_placement(
            families,
            lambda placement_ED: layer_seconds(cfg.cost, owner_E, placement_ED, tokens_ED, plan_of=self.compact_plan,
                                               window_s=float(clock.window_s), rematerialize=self.rematerialize,
                                               attention_s=clock.attention_s) - credit_of(placement_ED),
            window_t=min(self.overlap_degree(clock), cfg.num_experts), max_t=cfg.num_experts)
        taken = credit_of(choice.placement_ED)  # modelled_s: the placement's price, the credit apart
        return dataclasses.replace(choice, modelled_s=choice.modelled_s + taken, credit_s=taken)

    def post_gating(self, layer: int, owner_E: torch.Tensor, placement_ED: torch.Tensor, *,
                    tokens_ED: torch.Tensor, clock: Clock | None = None) -> LayerPlan:
        cfg = self.config
        if not cfg.calibration:
            return self._plan(owner_E, placement_ED)
        if cfg.cost is None:
            raise ValueError(f"{self.name}: calibration needs PolicyConfig.cost")
        placement_ED = placement_ED.to("cpu", torch.bool)
        cal = self.calibrate(owner_E, placement_ED, tokens_ED, clock=clock)
        return self._plan(owner_E, cal.placement_ED, calibrated_ED=cal.placement_ED & ~placement_ED, calibration=cal,
                          evicted_ED=placement_ED & ~cal.placement_ED)

    def calibrate(self, owner_E: torch.Tensor, placement_ED: torch.Tensor, tokens_ED: torch.Tensor, *,
                  clock: Clock | None = None) -> Calibration:
        """:func:`ds_fssdp.planner.calibrate` with this policy's materializer, dispatcher, the
        clock's latency budget and :meth:`calibration_overlap_degree`."""
        return calibrate(owner_E, placement_ED, tokens_ED, self.topology, self.config.cost,
                         overlap_degree=self.calibration_overlap_degree(clock), budget=self.config.budget,
                         latency_budget=self.latency_budget(clock), dispatcher=self.dispatcher,
                         materializer=self.materializer)

    def calibration_overlap_degree(self, clock: Clock | None = None) -> int:
        """Distinct experts calibration may replicate: the t of the hidden gather plus what the
        binding link moves within the latency budget (the calibration gather is on the critical
        path, so the attention window does not bound it; its budget does)."""
        E = self.config.num_experts
        return min(E, self.overlap_degree(clock) + self.config.cost.overlap_degree(self.latency_budget(clock)))

    def overlap_degree(self, clock: Clock | None) -> int:
        t = clock.overlap_degree if clock is not None and clock.overlap_degree is not None else None
        return self.config.overlap_degree if t is None else t

    def latency_budget(self, clock: Clock | None) -> float:
        b = clock.latency_budget if clock is not None and clock.latency_budget is not None else None
        return self.config.calibration_latency_budget if b is None else b


class FSSDPRematerializePolicy(FSSDPPolicy):
    name = "fssdp-rm"
    rematerialize = True

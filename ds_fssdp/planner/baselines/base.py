"""One interface for every placement policy: FSSDP, expert parallelism and the baselines.

Legend: L MoE layers, E experts per layer, D ranks, M moved expert states.

Each iteration a policy is called in the order the runtime runs (paper Figure 1, section 4):

1. ``reshard(step, history_load_LE, owner_LE=...)`` at the start of the iteration, before any
   layer: state migration on the critical path (SmartMoE's permutation every N iterations,
   FlexMoE's expand / shrink, FSSDP's Algorithm 2 every ``reshard_interval``). Returns a
   :class:`Reshard` (new owners and the expert states copied, each with its optimizer state) or
   None.
2. ``pre_gating(layer, owner_E, predicted_load_E)``: the placement P' gathered while the
   preceding attention computes (hidden). FSSDP: Algorithm 1 on the predicted loads; EP and
   SmartMoE: the shard; FlexMoE: the shard plus its persistent replicas.
3. ``route(tokens_ED)``: the tokens the gate actually dispatches (Uniform rewrites them).
4. ``post_gating(layer, owner_E, placement_ED, tokens_ED=...)``: the final placement once the
   actual loads are known, with what it adds moved on the critical path (FasterMoE's shadowing,
   FSSDP's calibration). Returns a :class:`LayerPlan`.
5. ``dispatch(layer_plan, tokens_ED)``: plan_EDD from the policy's dispatcher (injectable, Algorithm
   3 by default; Algorithm 1 is injectable too, as ``materializer``).

Policies are pure and deterministic: every rank that makes the same calls with the same inputs
gets the same answers, so the runtime exchanges only ``tokens_ED``. A policy object keeps state
across iterations only where the baseline it models does (FlexMoE's persistent replicas).

This is THE interface: the runtime (through :class:`ds_fssdp.planner.layer.LayerPlanner`;
``runtime/stage.py`` for ``reshard``), the simulator and the replay call it alike, only their
:class:`Clock` (t and calibration's latency budget) measured, modelled or read back.
"""
from __future__ import annotations

import math
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ds_fssdp.planner.calibrate import Calibration
from ds_fssdp.planner.cost import CostModel
from ds_fssdp.planner.dispatch import dispatch as planner_dispatch
from ds_fssdp.planner.dispatch import dispatch_plan
from ds_fssdp.planner.plan import DispatchPlan
from ds_fssdp.planner.materialize import materialize as algorithm1_materialize
from ds_fssdp.planner.shard import homogeneous_owner, shard_placement
from ds_fssdp.topology import Topology

Dispatcher = Callable[[torch.Tensor, torch.Tensor, Topology], torch.Tensor]
Materializer = Callable[..., torch.Tensor]  # materialize(owner_E, load_E, topology, *, overlap_degree, budget, base_ED)


@dataclass(frozen=True)
class Clock:
    """The knobs that depend on time, for one layer and iteration (None: the config's value)."""

    overlap_degree: int | None = None
    """t: distinct experts the pre-gating gather may replicate (hidden under the attention)."""
    latency_budget: float | None = None
    """Seconds calibration's gather may add to the critical path."""
    window_s: float | None = None
    """Seconds before the layer that hide its pre-gating gather (what ``overlap_degree`` came from);
    with ``PolicyConfig.overlap_by_time`` FSSDP searches t from there (``planner/overlap.py``)."""
    attention_s: float | None = None
    """Seconds of the layer's attention forward alone: the search by time prices the replica
    reduce against the attention backward (twice as long) plus the time the layer's backward
    exchange leaves the reduce's link free (``planner/scheduled.reduce_window_s``); None: against
    twice ``window_s``."""
    calibration_credit_s: float = 0.0
    """Seconds calibration is expected to save a placement that leaves it room (some rank lacks an
    expert: ``calibrate.leaves_room``): the
    layer's mean realized net saving over its last steps with room, set by
    :class:`~ds_fssdp.planner.layer.LayerPlanner` from its own post-gating results. The search by
    time takes it off such candidates' price: calibration sees the actual loads, the price only the
    predicted ones, on which it has nothing left to fix."""


@dataclass(frozen=True)
class PolicyConfig:
    """What every policy is built from. One config per model (all layers have ``num_experts``)."""

    num_experts: int
    num_layers: int
    topology: Topology
    budget: int = 0
    """m: ephemeral replicas per rank per layer (FSSDP; FSSDP-RM gets a larger one from the caller)."""
    overlap_degree: int = 0
    """t: distinct experts replicated per layer per iteration (FSSDP, Algorithm 2's hot set)."""
    cost: CostModel | None = None
    """Latency model; FasterMoE's shadowing, FSSDP's calibration and dispatch "balanced-time" need it."""
    placement: str = "paper"
    """FSSDP's pre-gating placement (:func:`ds_fssdp.planner.place`): "paper" (Algorithm 1, or the
    injected ``materializer``) or "joint" (it needs the predicted ``tokens_ED``)."""
    reshard_interval: int = 100
    """FSSDP: Algorithm 2 every this many iterations (0: never). Paper: 100."""
    overlap_by_time: bool = False
    """FSSDP: t per layer by the modelled layer time, from the clock's window up (needs ``cost`` and
    a clock with ``window_s``; :func:`ds_fssdp.planner.overlap.choose_overlap_degree`)."""
    calibration: bool = False
    """FSSDP: after gating, add replicas for the actual loads when the modelled gain pays."""
    calibration_latency_budget: float = math.inf
    """FSSDP: seconds the calibration gather may add to the critical path."""
    smartmoe_interval: int = 25
    """SmartMoE: permute experts between slots every this many iterations."""
    flexmoe_threshold: float = 1.2
    """FlexMoE: adjust while max / mean predicted rank load exceeds this."""
    flexmoe_slots: int = 1
    """FlexMoE: persistent replica slots reserved per rank per layer (full optimizer state)."""
    flexmoe_interval: int = 1
    """FlexMoE: check the balance every this many iterations."""
    fastermoe_max_shadow: int | None = None
    """FasterMoE: at most this many shadowed experts per layer (None: no cap)."""
    dispatch: str = "paper"
    """The dispatch mode (:func:`ds_fssdp.planner.dispatch.dispatch`) of the default dispatcher."""
    dispatch_slack: float = 0.0
    """The ``balanced`` dispatcher's row-cap slack."""

    def __post_init__(self):
        if self.num_experts < 1 or self.num_layers < 1:
            raise ValueError(f"PolicyConfig num_experts ({self.num_experts}) and num_layers ({self.num_layers}) "
                             f"must be >= 1")
        for key in ("budget", "overlap_degree", "reshard_interval", "flexmoe_slots"):
            if getattr(self, key) < 0:
                raise ValueError(f"PolicyConfig {key} ({getattr(self, key)}) must be >= 0")
        for key in ("smartmoe_interval", "flexmoe_interval"):
            if getattr(self, key) < 1:
                raise ValueError(f"PolicyConfig {key} ({getattr(self, key)}) must be >= 1")
        if self.flexmoe_threshold < 1.0:
            raise ValueError(f"PolicyConfig flexmoe_threshold ({self.flexmoe_threshold}) must be >= 1.0")
        if self.fastermoe_max_shadow is not None and self.fastermoe_max_shadow < 0:
            raise ValueError(f"PolicyConfig fastermoe_max_shadow ({self.fastermoe_max_shadow}) must be >= 0 or None")


@dataclass(frozen=True)
class Reshard:
    """State migration at the start of an iteration (critical path).

    ``copies_M4`` rows are (layer, expert, source rank, destination rank): the expert's parameters
    and optimizer state (fp32 master, Adam m and v) copied from source to destination. A migration
    (SmartMoE, Algorithm 2) also frees the source; a FlexMoE expansion keeps it."""

    owner_LE: torch.Tensor  # long [L, E]: owners after the migration
    copies_M4: torch.Tensor  # long [M, 4]


@dataclass(frozen=True)
class LayerPlan:
    """One layer's placement this iteration and what it moved (all bool [E, D], disjoint).

    * ``hidden_ED``: ephemeral replicas gathered from the owners during the preceding attention
      forward (SparseAllGather) and reduced back during the attention backward (SparseReduceScatter);
      with ``rematerialize`` gathered a second time before the backward.
    * ``calibrated_ED``: ephemeral replicas gathered after gating, on the critical path, reduced
      with the SparseReduceScatter (FSSDP calibration).
    * ``evicted_ED``: replicas gathered during the preceding attention that calibration dropped
      after gating (not in ``placement_ED``): no tokens go to them, they are neither reduced nor
      re-gathered for the backward.
    * ``shadow_ED``: replicas broadcast after gating and their gradients reduced after the
      backward, both on the critical path (FasterMoE shadowing).
    * ``persistent_ED``: persistent replicas with their own optimizer state, already in place; the
      gradients of every replicated expert are all-reduced among its holders (FlexMoE).
    """

    owner_E: torch.Tensor
    placement_ED: torch.Tensor
    hidden_ED: torch.Tensor
    calibrated_ED: torch.Tensor
    shadow_ED: torch.Tensor
    persistent_ED: torch.Tensor
    rematerialize: bool = False
    calibration: Calibration | None = None  # what FSSDP's calibration decided (None: it did not run)
    evicted_ED: torch.Tensor | None = None  # None: nothing evicted

    @property
    def gathered_ED(self) -> torch.Tensor:
        """Replicas the hidden gather moved: the ones kept and the ones calibration evicted."""
        return self.hidden_ED if self.evicted_ED is None else self.hidden_ED | self.evicted_ED

    @property
    def ephemeral_ED(self) -> torch.Tensor:
        """Replicas without optimizer state that live only this iteration."""
        return self.hidden_ED | self.calibrated_ED | self.shadow_ED


class Policy:
    """Base class: static expert parallelism (the shard placement, nothing moves)."""

    name = "ep"
    rematerialize = False

    def __init__(self, config: PolicyConfig, *, dispatcher: Dispatcher | None = None,
                 materializer: Materializer = algorithm1_materialize):
        """``dispatcher``: plan_EDD from (placement_ED, tokens_ED, topology); None: the planner's
        dispatcher in ``config.dispatch`` mode (Algorithm 3 for "paper"). ``materializer``:
        Algorithm 1 (FSSDP's placements and calibration); any implementation with
        :func:`ds_fssdp.planner.materialize`'s signature and results."""
        self.config = config
        self.topology = config.topology
        self._own_dispatcher = dispatcher is None
        self.dispatcher = dispatcher or functools.partial(planner_dispatch, mode=config.dispatch, cost=config.cost,
                                                          slack=config.dispatch_slack)
        self.materializer = materializer

    # -- memory the policy reserves beyond the shard ------------------------------------------------
    @property
    def reserved_slots(self) -> int:
        """Persistent replica slots (with optimizer state) reserved per rank per layer."""
        return 0

    def initial_owner(self) -> torch.Tensor:
        """long [L, E]: homogeneous sharding (the expert-parallel layout) for every layer."""
        E, L, D = self.config.num_experts, self.config.num_layers, self.topology.num_ranks
        return homogeneous_owner(E, D).expand(L, E).clone()

    # -- the phases --------------------------------------------------------------------------------
    def reshard(self, step: int, history_load_LE: torch.Tensor | None, *, owner_LE: torch.Tensor,
                clock: Clock | None = None) -> Reshard | None:
        return None

    def pre_gating(self, layer: int, owner_E: torch.Tensor, predicted_load_E: torch.Tensor | None, *,
                   clock: Clock | None = None) -> torch.Tensor:
        """The baselines plan nothing before gating."""
        return shard_placement(owner_E.to("cpu", torch.long), self.topology.num_ranks) | self.persistent_ED(
            layer, owner_E)

    def pre_gating_t(self, layer: int, owner_E: torch.Tensor, predicted_load_E: torch.Tensor | None, *,
                     clock: Clock | None = None) -> tuple:
        """``(placement_ED, t)``: :meth:`pre_gating`'s placement and the overlap degree it was planned
        with (-1: the policy has none)."""
        return self.pre_gating(layer, owner_E, predicted_load_E, clock=clock), -1

    def persistent_ED(self, layer: int, owner_E: torch.Tensor) -> torch.Tensor:
        """Persistent replicas of ``layer`` beyond the shard (bool [E, D]); the runtime gathers
        ``placement_ED & ~shard & ~persistent`` during the attention."""
        return torch.zeros(owner_E.numel(), self.topology.num_ranks, dtype=torch.bool)

    def route(self, tokens_ED: torch.Tensor) -> torch.Tensor:
        return tokens_ED

    def post_gating(self, layer: int, owner_E: torch.Tensor, placement_ED: torch.Tensor, *,
                    tokens_ED: torch.Tensor, clock: Clock | None = None) -> LayerPlan:
        return self._plan(owner_E, placement_ED)

    def dispatch(self, layer_plan: LayerPlan, tokens_ED: torch.Tensor) -> torch.Tensor:
        return self.dense_plan(layer_plan.placement_ED, tokens_ED)

    def dense_plan(self, placement_ED: torch.Tensor, tokens_ED: torch.Tensor) -> torch.Tensor:
        """The dispatcher's plan of ``tokens_ED`` over ``placement_ED`` as plan_EDD (an injected
        dispatcher may return either form)."""
        plan = self.dispatcher(placement_ED, tokens_ED, self.topology)
        return plan.dense() if isinstance(plan, DispatchPlan) else plan

    def dispatch_plan(self, layer_plan: LayerPlan, tokens_ED: torch.Tensor) -> DispatchPlan:
        """:meth:`dispatch` as the compact plan the runtime uses (the same plan, no dense
        [E, D, D] tensor on the planner's own dispatcher)."""
        return self.compact_plan(layer_plan.placement_ED, tokens_ED)

    def compact_plan(self, placement_ED: torch.Tensor, tokens_ED: torch.Tensor) -> DispatchPlan:
        """The dispatch of ``tokens_ED`` over ``placement_ED`` as a compact plan."""
        if not self._own_dispatcher:  # an injected dispatcher may return either form
            plan = self.dispatcher(placement_ED, tokens_ED, self.topology)
            return plan if isinstance(plan, DispatchPlan) else DispatchPlan.from_dense(placement_ED, plan)
        c = self.config
        return dispatch_plan(placement_ED, tokens_ED, self.topology, mode=c.dispatch, cost=c.cost,
                             slack=c.dispatch_slack)

    # -- helpers -----------------------------------------------------------------------------------
    def _plan(self, owner_E: torch.Tensor, placement_ED: torch.Tensor, *, calibrated_ED: torch.Tensor | None = None,
              shadow_ED: torch.Tensor | None = None, persistent_ED: torch.Tensor | None = None,
              calibration: Calibration | None = None, evicted_ED: torch.Tensor | None = None) -> LayerPlan:
        """Split ``placement_ED`` into the shard and the parts of :class:`LayerPlan` (what is not
        calibrated, shadow or persistent was gathered hidden; ``evicted_ED``: gathered hidden and
        dropped, outside ``placement_ED``)."""
        owner_E = owner_E.to("cpu", torch.long)
        placement_ED = placement_ED.to("cpu", torch.bool)
        shard_ED = shard_placement(owner_E, self.topology.num_ranks)
        if not bool(placement_ED[shard_ED].all()):
            raise ValueError(f"{self.name}: placement_ED must contain the shard placement of owner_E")
        beyond_ED = ~shard_ED
        calibrated_ED, shadow_ED, persistent_ED = (beyond_ED & (torch.zeros_like(placement_ED) if p is None else p)
                                                   for p in (calibrated_ED, shadow_ED, persistent_ED))
        hidden_ED = placement_ED & beyond_ED & ~(calibrated_ED | shadow_ED | persistent_ED)
        if evicted_ED is not None:
            evicted_ED = evicted_ED.to("cpu", torch.bool) & ~shard_ED
            if bool((evicted_ED & placement_ED).any()):
                raise ValueError(f"{self.name}: evicted replicas must not be in placement_ED")
            evicted_ED = evicted_ED if bool(evicted_ED.any()) else None
        return LayerPlan(owner_E=owner_E, placement_ED=placement_ED, hidden_ED=hidden_ED, calibrated_ED=calibrated_ED,
                         shadow_ED=shadow_ED, persistent_ED=persistent_ED, rematerialize=self.rematerialize,
                         calibration=calibration, evicted_ED=evicted_ED)

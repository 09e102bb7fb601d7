"""A layer's planner inputs, built in one place for the runtime, the simulator and the replay.

Legend: E experts, L MoE layers.

From the settings (the ``"fssdp"`` block's decision knobs, :class:`PlannerSettings`), the
topology, the cost model (hardware or fitted costs, the expert's shape) and the layers' expert
counts, :func:`planner_inputs` builds what a :class:`~ds_fssdp.planner.layer.LayerPlanner` decides
with:

* the policy object (every policy, EP, Uniform and fsmoe's EP included: a policy is a policy), one
  per distinct expert count;
* the policies that re-shard after a step (:func:`~ds_fssdp.planner.layer.migrating_policies`:
  Algorithm 2 every ``reshard_interval`` steps for every policy, as the runtime re-shards);
* the clock rule (:class:`ClockRule`): a layer's t and calibration's latency budget from its
  window (the runtime's measured, agreed window; a simulator's modelled one), and the re-shard's
  clock (layer 0's, as the runtime passes it);
* the sparse collectives' pricing (:data:`GATHER_RELAY`): as the runtime moves them, each chunk
  sent from its owner's node once per node it enters (``planner/transfers.py``'s two phases).

Callers differ only in where the window comes from; nothing else is built by a caller.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ds_fssdp.planner.baselines import Clock, Policy, PolicyConfig, make_policy
from ds_fssdp.planner.layer import LayerPlanner, migrating_policies

# The runtime's sparse collectives (planner/transfers.py, hierarchical or not) send every chunk
# from its owner: no node forwards a chunk it received to another node. CostModel(relay=False).
GATHER_RELAY = False


@dataclass(frozen=True)
class PlannerSettings:
    """The decision knobs of the ``"fssdp"`` block (``ds_fssdp/config.py``; see its docstrings)."""

    policy: str = "fssdp"
    rematerialize: bool = False
    budget: int = 0  # m, resolved ("auto" already turned into replicas)
    overlap_degree: int | str = 0  # t, or "auto": from each layer's window, searched by the layer's time
    calibration: bool = False
    calibration_latency_budget: float | None = None  # seconds; None: the layer's window
    placement: str = "paper"
    reshard_interval: int = 0
    smartmoe_interval: int = 25
    dispatch: str = "paper"
    dispatch_slack: float = 0.0
    topology_aware: bool = True  # two-phase collectives and two-hop exchanges across nodes
    t_by_time: bool = True  # "auto" t searched by the modelled layer time (False: the window's t alone)
    flexmoe_threshold: float = 1.2
    flexmoe_slots: int = 1
    flexmoe_interval: int = 1

    @classmethod
    def of(cls, config, *, budget: int) -> "PlannerSettings":
        """From an ``FSSDPConfig``, or the replay's settings of the same names (read by attribute:
        the planner imports no config module)."""
        return cls(policy=config.policy, rematerialize=bool(config.rematerialize), budget=int(budget),
                   overlap_degree=config.overlap_degree, calibration=bool(config.calibration),
                   calibration_latency_budget=config.calibration_latency_budget, placement=config.placement,
                   reshard_interval=int(config.reshard_interval), smartmoe_interval=int(config.smartmoe_interval),
                   dispatch=config.dispatch, dispatch_slack=float(config.dispatch_slack),
                   topology_aware=bool(config.topology_aware))

    @property
    def policy_name(self) -> str:
        """The policy object's name: FSSDP with re-materialization is ``fssdp-rm``; ``fsmoe`` is EP
        (FSMoE's schedule is how its exchange runs, not a placement)."""
        if self.policy == "fsmoe":
            return "ep"
        return "fssdp-rm" if self.policy == "fssdp" and self.rematerialize else self.policy

    @property
    def auto_t(self) -> bool:
        return self.overlap_degree == "auto"


@dataclass(frozen=True)
class ClockRule:
    """A layer's :class:`~ds_fssdp.planner.baselines.Clock` from its window.

    ``overlap_degree``: a fixed t, or "auto": t is what the window buys on the binding link
    (:meth:`CostModel.overlap_degree`, at most E; 0 before any window), and the policy also gets
    the window and the attention to search t by time. ``latency_budget``: calibration's seconds, or
    None: the window's (unlimited before any window)."""

    num_experts: int
    overlap_degree: int | str
    latency_budget: float | None
    cost: object = None  # CostModel: needed for "auto" t

    def clock(self, window_s: float | None, attention_s: float | None = None, *,
              num_experts: int | None = None) -> Clock:
        """``num_experts``: the layer's (default the first layer's)."""
        t, window, attention = self.overlap_degree, None, None
        if t == "auto":
            E = self.num_experts if num_experts is None else int(num_experts)
            t = 0 if window_s is None else min(E, self.cost.overlap_degree(window_s))
            window, attention = window_s, attention_s
        budget = self.latency_budget
        if budget is None:
            budget = math.inf if window_s is None else window_s
        return Clock(overlap_degree=int(t), latency_budget=float(budget), window_s=window, attention_s=attention)

    def reshard_clock(self, window_L: list, attention_L: list | None = None) -> Clock:
        """The clock a step's re-shards plan with: layer 0's (Algorithm 2's hot set uses its t)."""
        return self.clock(window_L[0] if window_L else None, attention_L[0] if attention_L else None)


@dataclass(frozen=True)
class PlannerInputs:
    policy: Policy  # the policy of the first layer's expert count
    policies: dict  # expert count -> policy object
    migrators: list  # who re-shards after a step, in order (planner.layer.migrations)
    clock_rule: ClockRule
    relay: bool  # the sparse collectives' pricing (CostModel.sparse_collective_time)
    two_hops: bool  # the token exchange crosses nodes once per node (ExchangeOptions.two_hops)

    def policy_for(self, num_experts: int) -> Policy:
        return self.policies[num_experts]


def planner_inputs(settings: PlannerSettings, *, num_experts_L: list, topology, cost=None, dispatcher=None,
                   materializer=None) -> PlannerInputs:
    """Everything a layer's planner decides with, for layers of ``num_experts_L`` experts on
    ``topology`` priced by ``cost`` (a :class:`~ds_fssdp.planner.cost.CostModel`, None where no
    decision needs one). ``dispatcher`` / ``materializer``: the simulators' injected algorithms
    (None: the policy's own)."""
    s = settings
    E0, L = int(num_experts_L[0]), len(num_experts_L)
    latency = s.calibration_latency_budget
    config = PolicyConfig(num_experts=E0, num_layers=L, topology=topology, budget=s.budget,
                          overlap_degree=0 if s.auto_t else int(s.overlap_degree), cost=cost, placement=s.placement,
                          reshard_interval=s.reshard_interval, calibration=s.calibration,
                          calibration_latency_budget=math.inf if latency is None else float(latency),
                          smartmoe_interval=s.smartmoe_interval, dispatch=s.dispatch,
                          dispatch_slack=float(s.dispatch_slack), overlap_by_time=s.auto_t and s.t_by_time,
                          flexmoe_threshold=s.flexmoe_threshold, flexmoe_slots=s.flexmoe_slots,
                          flexmoe_interval=s.flexmoe_interval)
    extra = {} if materializer is None else {"materializer": materializer}
    # one policy object decides for every layer of one expert count
    policies = {E: make_policy(s.policy_name, dataclasses.replace(config, num_experts=E), dispatcher=dispatcher,
                               **extra) for E in dict.fromkeys(int(E) for E in num_experts_L)}
    policy = policies[E0]
    rule = ClockRule(num_experts=E0, overlap_degree=s.overlap_degree, latency_budget=latency, cost=cost)
    return PlannerInputs(policy=policy, policies=policies,
                         migrators=migrating_policies(policy, reshard_interval=s.reshard_interval), clock_rule=rule,
                         relay=GATHER_RELAY, two_hops=bool(s.topology_aware))


def build_policies(config, *, num_experts: list, topology, budget: int, cost, predictor) -> tuple:
    """``(PlannerInputs, planners)``: :func:`planner_inputs` of the ``fssdp`` block ``config`` (the
    runtime's ``FSSDPConfig``, or the replay's settings of the same names) and each layer's
    :class:`~ds_fssdp.planner.layer.LayerPlanner` (``num_experts``: each layer's expert count), for
    the materialization budget ``budget`` and cost model ``cost`` (None: none needed)."""
    inputs = planner_inputs(PlannerSettings.of(config, budget=budget), num_experts_L=num_experts, topology=topology,
                            cost=cost)
    return inputs, [LayerPlanner(inputs.policy_for(E), predictor, i) for i, E in enumerate(num_experts)]

"""Replay the runtime's decisions from a recorded trace (no communication).

Legend: S steps, L MoE layers, E experts, D ranks.

A trace records each iteration's ``tokens_ED`` and, from the runtime, what it decided
(``decision_*`` arrays, docs/traces.md) and the clock it decided with (t and calibration's latency
budget per layer and step). The replay drives the same policy object as the runtime
(:class:`~ds_fssdp.planner.layer.LayerPlanner`, :func:`~ds_fssdp.planner.layer.migrations`) with
the same predictor fed the same counts, and the recorded clock: so it makes the runtime's
decisions again, step by step (re-shards and SmartMoE's permutations, placements, calibration
or shadowing, dispatch plans), and :func:`compare` says where they differ. What it cannot know is
listed in :attr:`Replay.notes`: a trace without the decision record (not from the runtime) is
replayed with the sidecar's t ("auto": unlimited) and latency budget; calibration, FasterMoE
need the run's hardware; placement "cost" (removed) is replayed as "joint".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ds_fssdp.defaults import DISPATCH_SLACK, SMARTMOE_INTERVAL
from ds_fssdp.planner.decision import Decision, decision_arrays
from ds_fssdp.planner import (Clock, CostModel, ExpertShape, Hardware, LoadPredictor, PolicyConfig, homogeneous_owner,
                              make_policy)
from ds_fssdp.planner.layer import LayerPlanner, migrating_policies, migrations
from ds_fssdp.planner.schedule import ScheduleCosts
from ds_fssdp.planner.scheduled import ExchangeOptions, ScheduledCostModel, exchange_decision
from ds_fssdp.sim.traces import Trace
from ds_fssdp.topology import Topology

@dataclass
class ReplaySettings:
    policy: str = "fssdp"
    budget: int = 2
    overlap_degree: int = 4
    window: int = 5
    ranks_per_node: int | None = None  # None: one node
    placement: str = "paper"  # the runtime's default
    dispatch: str = "balanced"
    dispatch_slack: float = DISPATCH_SLACK
    reshard_interval: int = 0
    calibration: bool = False
    calibration_latency_budget: float | None = None  # None: the recorded window
    smartmoe_interval: int = SMARTMOE_INTERVAL
    rematerialize: bool = False
    overlap_by_time: bool = False  # overlap_degree "auto": t searched from the recorded window
    hardware: dict | None = None  # the run's cost model: Hardware's fields
    expert_shape: dict | None = None  # and ExpertShape's
    # how the run's layers exchanged tokens (the by-time decisions' layer price; None: a trace from
    # before it was recorded, priced as the serial exchanges it then was)
    exchange: dict | None = None  # top_k, one_copy_per_destination, pipeline_degree, topology_aware
    notes: list = field(default_factory=list)

    def cost_model(self, topology: Topology) -> CostModel | None:
        """The run's cost model: the recorded hardware and expert, the layer priced as the run's
        exchange (:class:`~ds_fssdp.planner.scheduled.ScheduledCostModel`, as the runtime builds it)."""
        if self.hardware is None or self.expert_shape is None:
            return None
        hw, shape = Hardware(**self.hardware), ExpertShape(**self.expert_shape)
        if self.exchange is None:
            return CostModel(hw, shape, topology)
        ex = self.exchange
        options = ExchangeOptions.of(shape, top_k=ex["top_k"], one_copy=ex["one_copy_per_destination"],
                                     pipeline_degree=ex["pipeline_degree"], two_hops=ex["topology_aware"],
                                     side_ratio=ex.get("side_ratio", 0.0))
        return ScheduledCostModel(hw, shape, topology, exchange=options)

    def make_policy(self, topology: Topology, *, num_experts: int, num_layers: int):
        """The runtime's policy object (``runtime/policy_setup.build_policies``) from these settings."""
        budget = self.calibration_latency_budget
        config = PolicyConfig(num_experts=num_experts, num_layers=num_layers, topology=topology, budget=self.budget,
                              overlap_degree=self.overlap_degree, cost=self.cost_model(topology),
                              placement=self.placement, reshard_interval=self.reshard_interval,
                              calibration=self.calibration,
                              calibration_latency_budget=float("inf") if budget is None else float(budget),
                              smartmoe_interval=self.smartmoe_interval, dispatch=self.dispatch,
                              dispatch_slack=self.dispatch_slack, overlap_by_time=self.overlap_by_time)
        name = "fssdp-rm" if self.policy == "fssdp" and self.rematerialize else self.policy
        return make_policy(name, config)

    @classmethod
    def from_trace(cls, trace: Trace, **overrides) -> "ReplaySettings":
        """Settings from the trace's sidecar (written by the runtime), then ``overrides`` (None: keep)."""
        meta = trace.meta
        s = cls()
        notes = []
        s.policy = str(meta.get("policy", s.policy))
        s.budget = int(meta.get("materialization_budget", s.budget))
        t = meta.get("overlap_degree", s.overlap_degree)
        recorded = "decision_t" in trace.arrays
        if t == "auto":
            s.overlap_by_time = True
            t = trace.num_experts
            if not recorded:
                notes.append('overlap_degree "auto" was measured per layer at run time; replayed as unlimited')
        s.overlap_degree = int(t)
        s.window = int(meta.get("load_window", s.window))
        s.ranks_per_node = meta.get("ranks_per_node")
        s.placement = str(meta.get("placement", s.placement))
        s.dispatch = str(meta.get("dispatch", s.dispatch))
        s.dispatch_slack = float(meta.get("dispatch_slack", s.dispatch_slack))
        s.reshard_interval = int(meta.get("reshard_interval", 0) or 0)
        s.calibration = bool(meta.get("calibration", False))
        s.calibration_latency_budget = meta.get("calibration_latency_budget")
        s.smartmoe_interval = int(meta.get("smartmoe_interval", s.smartmoe_interval))
        s.rematerialize = bool(meta.get("rematerialize", False))
        s.hardware, s.expert_shape = meta.get("hardware"), meta.get("expert_shape")
        if "pipeline_degree" in meta:
            s.exchange = {k: meta[k] for k in ("top_k", "one_copy_per_destination", "pipeline_degree",
                                                "topology_aware")}
            s.exchange["side_ratio"] = float(meta.get("side_ratio", 0.0))  # 0: a trace from before it was recorded
        for key, value in overrides.items():
            if value is not None:
                setattr(s, key, value)
        no_cost = s.hardware is None or s.expert_shape is None
        if no_cost and s.dispatch == "balanced-time":
            notes.append(f"dispatch {s.dispatch!r} needs the run's cost model; replayed with 'balanced'")
            s.dispatch = "balanced"
        if s.placement == "cost":
            notes.append("placement 'cost' (removed from the runtime) replayed as 'joint'")
            s.placement = "joint"
        if no_cost and (s.calibration or s.policy == "fastermoe"):
            notes.append("replicas added after gating (calibration / FasterMoE) need the run's hardware; not shown")
            s.calibration = False
            if s.policy == "fastermoe":
                s.policy = "ep"
        if s.calibration and not recorded and s.calibration_latency_budget is None:
            notes.append("calibration's latency budget was the measured window; replayed as unlimited")
        s.notes = notes
        return s


@dataclass
class Replay:
    settings: ReplaySettings
    owner_SLE: np.ndarray  # long: the owners at step s in layer l
    held_SLED: np.ndarray  # bool: rank d holds expert e (owner or replica) at step s in layer l
    rows_SLD: np.ndarray  # int64: rows (token, expert) rank d computes with those holders
    ep_rows_SLD: np.ndarray  # int64: the same with the owners alone (static EP)
    decisions: dict  # the ``decision_*`` arrays the runtime records, replayed ([S, L, ...] each)
    reshards: list = field(default_factory=list)  # per step: the Reshards applied before it (in order)

    @property
    def notes(self) -> list:
        return self.settings.notes

    @property
    def owner_E(self) -> np.ndarray:
        """The first step's owners of layer 0 (the homogeneous start)."""
        return self.owner_SLE[0, 0]

    def replicas_SL(self) -> np.ndarray:
        return self.held_SLED.sum((2, 3)) - self.held_SLED.shape[2]

    def replica_frequency_LED(self) -> np.ndarray:
        """Fraction of iterations in which rank d held a replica (not the shard) of expert e."""
        S, L, E, D = self.held_SLED.shape
        owner_SLED = np.zeros_like(self.held_SLED)
        s, l, e = np.meshgrid(np.arange(S), np.arange(L), np.arange(E), indexing="ij")
        owner_SLED[s, l, e, self.owner_SLE] = True
        return (self.held_SLED & ~owner_SLED).mean(0)

    def straggler_SL(self) -> np.ndarray:
        return _straggler(self.rows_SLD)

    def ep_straggler_SL(self) -> np.ndarray:
        return _straggler(self.ep_rows_SLD)


def replay(trace: Trace, settings: ReplaySettings | None = None) -> Replay:
    s = settings or ReplaySettings.from_trace(trace)
    S, L, E, D = trace.tokens_SLED.shape
    topology = Topology(num_ranks=D, ranks_per_node=int(s.ranks_per_node or D))
    policy = s.make_policy(topology, num_experts=E, num_layers=L)
    predictor = LoadPredictor([E] * L, window=s.window)
    planners = [LayerPlanner(policy, predictor, l) for l in range(L)]
    migrators = migrating_policies(policy, reshard_interval=s.reshard_interval)
    clock_t = trace.arrays.get("decision_t")
    clock_b = trace.arrays.get("decision_latency_budget")
    clock_w = trace.arrays.get("decision_window_s")
    clock_a = trace.arrays.get("decision_attention_s")  # absent: a trace from before it was recorded
    costs_SL8 = trace.arrays.get("decision_schedule_costs")  # the schedule's costs each decision priced with
    side_SL = trace.arrays.get("decision_side_ratio")  # the work beside the exchange each priced (absent: none)
    cost = policy.config.cost
    default_costs = getattr(cost, "costs", None)
    # a trace that records the exchange's inputs: its degrees and one copy per destination replay too
    exchange_recorded = (s.exchange is not None and costs_SL8 is not None
                         and "decision_row_bytes" in trace.arrays and "decision_degrees" in trace.arrays)
    owner_LE = homogeneous_owner(E, D).expand(L, E).clone()
    tokens = torch.from_numpy(trace.tokens_SLED.astype(np.int64))
    steps, reshards = [], []
    for step in range(S):
        clocks = [_clock(s, clock_t, clock_b, clock_w, clock_a, step, l) for l in range(L)]
        reshards.append(migrations(migrators, step, predictor.predict_all(), owner_LE, clock=clocks[0]))
        for r in reshards[-1]:
            owner_LE = r.owner_LE
        decisions = []
        for l, planner in enumerate(planners):
            tokens_ED = tokens[step, l]
            costs = _recorded_costs(costs_SL8, step, l)
            if default_costs is not None:  # the runtime prices with its fitted costs where it has them
                cost.costs = default_costs if costs is None else costs
            placed_ED, overlap_t = planner.pre_gating_t(owner_LE[l], clocks[l])
            lp = planner.post_gating(owner_LE[l], placed_ED, tokens_ED, clocks[l], overlap_t=overlap_t)
            plan = planner.dispatch(lp, tokens_ED)
            planner.observe(tokens_ED)
            degrees, one_copy, row_bytes, side_ratio = (-1, -1), -1, (-1, -1), 0.0
            if exchange_recorded:  # the exchange decision retaken from the recorded costs and row sizes
                row_bytes = tuple(int(b) for b in trace.arrays["decision_row_bytes"][step, l])
                if side_SL is not None:
                    side_ratio = float(side_SL[step, l])
                degrees, one_copy = exchange_decision(
                    costs, lambda: plan.traffic_DD().numpy(), pipeline_degree=s.exchange["pipeline_degree"],
                    one_copy=s.exchange["one_copy_per_destination"], ranks_per_node=topology.ranks_per_node,
                    token_bytes=row_bytes[0], top_k=int(s.exchange["top_k"]), weight_bytes=row_bytes[1],
                    two_hops=bool(s.exchange["topology_aware"]), side_ratio=side_ratio)
            decisions.append(Decision.of(owner_LE[l], placed_ED, lp, plan, clocks[l], degrees, int(one_copy),
                                         overlap_t=overlap_t, schedule_costs=costs, row_bytes=row_bytes,
                                         side_ratio=side_ratio))
        steps.append(decision_arrays(decisions))
    if not steps:
        return Replay(settings=s, owner_SLE=np.zeros((0, L, E), np.int64), held_SLED=np.zeros((0, L, E, D), bool),
                      rows_SLD=np.zeros((0, L, D), np.int64), ep_rows_SLD=np.zeros((0, L, D), np.int64), decisions={})
    rec = {k: np.stack([d[k] for d in steps]) for k in steps[0]}
    # The pipeline degrees and one copy per destination follow the run's schedule costs (fitted at
    # initialize and refitted from timings): replayed where the trace records them per decision.
    if not exchange_recorded:
        for key in ("decision_degrees", "decision_one_copy", "decision_row_bytes"):
            rec.pop(key)
    if clock_a is None:  # a trace from before the attention was recorded: nothing to compare it with
        rec.pop("decision_attention_s")
    if costs_SL8 is None:
        rec.pop("decision_schedule_costs")
    if side_SL is None or not exchange_recorded:
        rec.pop("decision_side_ratio")
    # Static EP: every owner computes all its experts' rows.
    ep_rows = np.zeros((S, L, D), dtype=np.int64)
    load_SLE = trace.tokens_SLED.sum(3, dtype=np.int64)
    for e, d in enumerate(homogeneous_owner(E, D).tolist()):
        ep_rows[:, :, d] += load_SLE[:, :, e]
    return Replay(settings=s, owner_SLE=rec["decision_owner"], held_SLED=rec["decision_held"],
                  rows_SLD=rec["decision_rows"], ep_rows_SLD=ep_rows, decisions=rec, reshards=reshards)


def compare(trace: Trace, rep: Replay) -> list:
    """Where the replayed decisions differ from the recorded ones: ``(key, step, layer)`` of every
    first difference per key ([] when the runtime made exactly the replay's decisions)."""
    diffs = []
    for key, want in rep.decisions.items():
        got = trace.arrays.get(key)
        if got is None:
            diffs.append((key, None, None))
            continue
        same = got == want
        if np.issubdtype(want.dtype, np.floating):  # nan: no budget, no window
            same |= np.isnan(got) & np.isnan(want)
        bad = np.argwhere(~same.reshape(same.shape[0], same.shape[1], -1).all(2))
        if bad.size:
            diffs.append((key, int(bad[0, 0]), int(bad[0, 1])))
    return diffs


def _recorded_costs(costs_SL8, step: int, l: int) -> ScheduleCosts | None:
    """The schedule's costs the runtime decided (step, layer) with; None: none recorded."""
    if costs_SL8 is None or np.isnan(costs_SL8[step, l]).any():
        return None
    return ScheduleCosts.from_row(costs_SL8[step, l])


def _clock(s: ReplaySettings, clock_t, clock_b, clock_w, clock_a, step: int, l: int) -> Clock:
    """The recorded clock of (step, layer), else the settings' (a trace without a decision record)."""
    if clock_t is None:
        budget = s.calibration_latency_budget
        return Clock(overlap_degree=s.overlap_degree, latency_budget=float("inf") if budget is None else float(budget))
    w = None if clock_w is None or np.isnan(clock_w[step, l]) else float(clock_w[step, l])
    a = None if clock_a is None or np.isnan(clock_a[step, l]) else float(clock_a[step, l])
    return Clock(overlap_degree=int(clock_t[step, l]), latency_budget=float(clock_b[step, l]), window_s=w,
                 attention_s=a)


def _straggler(rows_SLD: np.ndarray) -> np.ndarray:
    rows = rows_SLD.astype(np.float64)
    mean = rows.mean(-1)
    return np.divide(rows.max(-1), mean, out=np.ones_like(mean), where=mean > 0)

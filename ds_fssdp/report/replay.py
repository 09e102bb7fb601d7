"""Replay the runtime's decisions from a recorded trace's inputs (no communication, no DeepSpeed).

Legend: S trace rows (training forwards: micro-steps), L MoE layers, E experts, D ranks.

A trace written by the runtime records each training forward's inputs: the all-gathered
``tokens_ED`` of every layer, the windows every rank agreed on (``agreed_window_s``,
``agreed_attention_s``), the optimizer steps applied before it (``optimizer_step``), the
schedule's costs each layer decided with (fitted or ``fssdp.hardware``'s) and the row sizes the
exchange decision priced; the sidecar records the config and the measured hardware. From those
alone the replay derives every decision again through the functions the runtime calls:
:func:`~ds_fssdp.planner.inputs.build_policies` (the policy, the re-sharding policies, each
layer's :class:`~ds_fssdp.planner.layer.LayerPlanner`), the clock rule (``planner.inputs.ClockRule``)
(t and calibration's latency budget from the window), :func:`~ds_fssdp.planner.layer.migrations`
at each optimizer step the trace's rows cross (not at each row: with gradient accumulation a step
spans several rows; with several FSSDP groups on the world's loads the runtime recorded,
``reshard_world_load``, the trace holding one group's counts), and :func:`~ds_fssdp.planner.scheduled.exchange_decision`. It reads none of
the runtime's decisions back; ``report/check.py`` compares them with the record.

A trace without the inputs (not from the runtime, or from before they were recorded) is replayed
with what is known, and :attr:`Replay.notes` says what is not: each row its own step, no window
(t "auto" unlimited, calibration's budget the configured one or unlimited); calibration and
FasterMoE need the run's hardware; placement "cost" (removed) is replayed as "joint".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ds_fssdp.defaults import DISPATCH_SLACK, SMARTMOE_INTERVAL
from ds_fssdp.planner import CostModel, ExpertShape, Hardware, LoadPredictor, homogeneous_owner
from ds_fssdp.planner.inputs import build_policies
from ds_fssdp.planner.layer import migrations
from ds_fssdp.planner.decision import Decision, decision_arrays
from ds_fssdp.planner.schedule import ScheduleCosts
from ds_fssdp.planner.scheduled import ExchangeOptions, ScheduledCostModel, exchange_decision
from ds_fssdp.sim.traces import Trace
from ds_fssdp.topology import Topology

# What the runtime records per decision as an input (priced with, not decided): read, never compared.
INPUT_ARRAYS = ("decision_schedule_costs", "decision_row_bytes", "decision_side_ratio")
# The runtime's other inputs per row (docs/traces.md): the steps, the agreed windows.
STEP_INPUTS = ("optimizer_step", "agreed_window_s", "agreed_attention_s")
# The sidecar's settings read as they are (key: ReplaySettings field, type), the field's default when absent.
_META = {"policy": ("policy", str), "materialization_budget": ("budget", int), "load_window": ("window", int),
         "placement": ("placement", str), "dispatch": ("dispatch", str), "dispatch_slack": ("dispatch_slack", float),
         "calibration": ("calibration", bool), "smartmoe_interval": ("smartmoe_interval", int),
         "rematerialize": ("rematerialize", bool), "fssdp_groups": ("fssdp_groups", int)}


@dataclass
class ReplaySettings:
    """The run's ``fssdp`` block as the sidecar records it (the names ``build_policies`` reads)."""
    policy: str = "fssdp"
    budget: int = 2
    overlap_degree: int | str = 4  # or "auto": from the agreed window
    window: int = 5  # the load predictor's
    ranks_per_node: int | None = None  # None: one node
    placement: str = "paper"  # the runtime's default
    dispatch: str = "balanced"
    dispatch_slack: float = DISPATCH_SLACK
    reshard_interval: int = 0
    calibration: bool = False
    calibration_latency_budget: float | None = None  # None: the agreed window
    smartmoe_interval: int = SMARTMOE_INTERVAL
    rematerialize: bool = False
    hardware: dict | None = None  # the run's cost model: Hardware's fields
    expert_shape: dict | None = None  # and ExpertShape's
    # how the run's layers exchanged tokens (the by-time decisions' layer price; None: a trace from
    # before it was recorded, priced as the serial exchanges it then was)
    exchange: dict | None = None  # top_k, one_copy_per_destination, pipeline_degree, topology_aware
    fssdp_groups: int = 1  # FSSDP groups of the run (the re-shards' loads are summed over them: recorded)
    notes: list = field(default_factory=list)

    @property
    def topology_aware(self) -> bool:
        """Two-phase collectives and two hops across nodes (the config's default without a record)."""
        return bool((self.exchange or {}).get("topology_aware", True))

    def cost_model(self, topology: Topology, *, costs=None, two_hops=None) -> CostModel | None:
        """The run's cost model: the recorded hardware and expert, the layer priced as the run's
        exchange (:class:`~ds_fssdp.planner.scheduled.ScheduledCostModel`, as the runtime builds it).
        ``two_hops``: a function returning the planner inputs' (None: the recorded setting's)."""
        if self.hardware is None or self.expert_shape is None:
            return None
        hw, shape = Hardware(**self.hardware), ExpertShape(**self.expert_shape)
        if self.exchange is None:
            return CostModel(hw, shape, topology)
        ex = self.exchange
        hops = two_hops if two_hops is not None else (lambda: self.topology_aware)

        def options():
            return ExchangeOptions.of(shape, top_k=ex["top_k"], one_copy=ex["one_copy_per_destination"],
                                      pipeline_degree=ex["pipeline_degree"], two_hops=hops(),
                                      side_ratio=ex.get("side_ratio", 0.0))
        return ScheduledCostModel(hw, shape, topology, exchange=options, costs=costs)

    @classmethod
    def from_trace(cls, trace: Trace, **overrides) -> "ReplaySettings":
        """Settings from the trace's sidecar (written by the runtime), then ``overrides`` (None: keep)."""
        meta = trace.meta
        s = cls()
        notes = []
        for key, (name, kind) in _META.items():  # missing: the default
            setattr(s, name, kind(meta.get(key, getattr(s, name))))
        s.reshard_interval = int(meta.get("reshard_interval") or 0)
        for name in ("ranks_per_node", "calibration_latency_budget", "hardware", "expert_shape"):
            setattr(s, name, meta.get(name))
        t = meta.get("overlap_degree", s.overlap_degree)
        windows = "agreed_window_s" in trace.arrays
        if t == "auto" and not windows:
            notes.append('overlap_degree "auto" was derived from windows this trace does not record; replayed as '
                         'unlimited')
            t = trace.num_experts
        s.overlap_degree = t if t == "auto" else int(t)
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
        if s.calibration and not windows and s.calibration_latency_budget is None:
            notes.append("calibration's latency budget was the agreed window, which this trace does not record; "
                         "replayed as unlimited")
        if "optimizer_step" not in trace.arrays:
            notes.append("optimizer steps not recorded: each row replayed as its own step")
        s.notes = notes
        return s


@dataclass
class Replay:
    settings: ReplaySettings
    owner_SLE: np.ndarray  # long: the owners at step s in layer l
    held_SLED: np.ndarray  # bool: rank d holds expert e (owner or replica) at step s in layer l
    rows_SLD: np.ndarray  # int64: rows (token, expert) rank d computes with those holders
    ep_rows_SLD: np.ndarray  # int64: the same with the owners alone (static EP)
    decisions: dict  # the ``decision_*`` arrays the runtime records, derived ([S, L, ...] each)
    reshards: list = field(default_factory=list)  # per row: the Reshards applied before it (in order)
    reshard_steps: list = field(default_factory=list)  # the optimizer steps after which a re-shard moved experts

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


class _Inputs:
    """One trace's per-row inputs (nan / absent: none)."""

    def __init__(self, trace: Trace):
        a = trace.arrays
        S, L = trace.tokens_SLED.shape[:2]
        nan_SL = np.full((S, L), np.nan)
        self.step_S = a["optimizer_step"].astype(np.int64) if "optimizer_step" in a else np.arange(S)
        self.per_row_steps = "optimizer_step" not in a
        self.window_SL = a.get("agreed_window_s", nan_SL)
        self.attention_SL = a.get("agreed_attention_s", nan_SL)
        self.costs_SL8 = a.get("decision_schedule_costs")
        self.row_bytes_SL2 = a.get("decision_row_bytes")
        self.side_SL = a.get("decision_side_ratio")
        self.world_load_SLE = a.get("reshard_world_load")  # several FSSDP groups: what the re-shards planned from

    def reshard_load(self, row: int, predictor: LoadPredictor):
        """The loads the re-shards before ``row`` plan from: the world's the runtime recorded (several
        FSSDP groups; all nan: none yet), else predicted from the trace's counts."""
        if self.world_load_SLE is None:
            return predictor.predict_all()
        load_LE = self.world_load_SLE[row]
        return None if np.isnan(load_LE).all() else torch.from_numpy(load_LE.astype(np.float64))

    def window(self, row: int, l: int) -> tuple:
        w, a = self.window_SL[row, l], self.attention_SL[row, l]
        return (None if np.isnan(w) else float(w)), (None if np.isnan(a) else float(a))

    def costs(self, row: int, l: int) -> ScheduleCosts | None:
        """The schedule's costs the runtime decided (row, layer) with; None: none recorded."""
        if self.costs_SL8 is None or np.isnan(self.costs_SL8[row, l]).any():
            return None
        return ScheduleCosts.from_row(self.costs_SL8[row, l])


def replay(trace: Trace, settings: ReplaySettings | None = None) -> Replay:
    s = settings or ReplaySettings.from_trace(trace)
    S, L, E, D = trace.tokens_SLED.shape
    topology = Topology(num_ranks=D, ranks_per_node=int(s.ranks_per_node or D))
    predictor = LoadPredictor([E] * L, window=s.window)
    priced = {"costs": None}  # the schedule's costs the decision being replayed was priced with
    built = None  # the planner inputs: their two hops price the exchange (read when a plan is priced)
    cost = s.cost_model(topology, costs=lambda: priced["costs"], two_hops=lambda: built.two_hops)
    built, planners = build_policies(s, num_experts=[E] * L, topology=topology, budget=s.budget, cost=cost,
                                     predictor=predictor)
    migrators, rule = built.migrators, built.clock_rule
    inputs = _Inputs(trace)
    # a trace that records the exchange's inputs: its degrees and one copy per destination are derived too
    exchange_recorded = (s.exchange is not None and inputs.costs_SL8 is not None
                         and inputs.row_bytes_SL2 is not None and "decision_degrees" in trace.arrays)
    owner_LE = homogeneous_owner(E, D).expand(L, E).clone()
    tokens = torch.from_numpy(trace.tokens_SLED.astype(np.int64))
    rows, reshards, reshard_steps = [], [], []
    for row in range(S):
        clocks = [rule.clock(*inputs.window(row, l), num_experts=E) for l in range(L)]
        step = int(inputs.step_S[row])
        # The runtime re-shards after each applied optimizer step (its step count, then the rows
        # after it carry); a trace without the count: before every row.
        crossed = inputs.per_row_steps or (row > 0 and step != int(inputs.step_S[row - 1]))
        done = migrations(migrators, step, inputs.reshard_load(row, predictor), owner_LE,
                          clock=clocks[0]) if crossed else []
        reshards.append(done)
        if done:
            reshard_steps.append(step)
            owner_LE = done[-1].owner_LE
        decisions = []
        for l, planner in enumerate(planners):
            tokens_ED = tokens[row, l]
            costs = inputs.costs(row, l)
            priced["costs"] = costs  # the runtime's fitted costs where it had them, else the hardware's
            placed_ED, overlap_t = planner.pre_gating_t(owner_LE[l], clocks[l])
            lp = planner.post_gating(owner_LE[l], placed_ED, tokens_ED, clocks[l], overlap_t=overlap_t)
            plan = planner.dispatch(lp, tokens_ED)
            planner.observe(tokens_ED)
            degrees, one_copy, row_bytes = (-1, -1), -1, (-1, -1)
            side_ratio = 0.0 if inputs.side_SL is None else float(inputs.side_SL[row, l])
            if exchange_recorded:  # the exchange decision from the recorded costs and row sizes
                row_bytes = tuple(int(b) for b in inputs.row_bytes_SL2[row, l])
                degrees, one_copy = exchange_decision(
                    costs, lambda: plan.traffic_DD().numpy(), pipeline_degree=s.exchange["pipeline_degree"],
                    one_copy=s.exchange["one_copy_per_destination"], ranks_per_node=topology.ranks_per_node,
                    token_bytes=row_bytes[0], top_k=int(s.exchange["top_k"]), weight_bytes=row_bytes[1],
                    two_hops=built.two_hops, side_ratio=side_ratio)
            decisions.append(Decision.of(owner_LE[l], placed_ED, lp, plan, clocks[l], degrees, int(one_copy),
                                         overlap_t=overlap_t, schedule_costs=costs, row_bytes=row_bytes,
                                         side_ratio=side_ratio))
        rows.append(decision_arrays(decisions))
    if not rows:
        return Replay(settings=s, owner_SLE=np.zeros((0, L, E), np.int64), held_SLED=np.zeros((0, L, E, D), bool),
                      rows_SLD=np.zeros((0, L, D), np.int64), ep_rows_SLD=np.zeros((0, L, D), np.int64), decisions={})
    rec = {k: np.stack([d[k] for d in rows]) for k in rows[0] if k not in INPUT_ARRAYS}
    # The pipeline degrees and one copy per destination follow the run's schedule costs (fitted at
    # initialize and refitted from timings): derived where the trace records them per decision.
    if not exchange_recorded:
        for key in ("decision_degrees", "decision_one_copy"):
            rec.pop(key)
    if "decision_attention_s" not in trace.arrays:  # a trace from before it was recorded
        rec.pop("decision_attention_s")
    # Static EP: every owner computes all its experts' rows (the loads times the one-hot owners [E, D]).
    ep_rows = trace.tokens_SLED.sum(3, dtype=np.int64) @ np.eye(D, dtype=np.int64)[homogeneous_owner(E, D).numpy()]
    return Replay(settings=s, owner_SLE=rec["decision_owner"], held_SLED=rec["decision_held"],
                  rows_SLD=rec["decision_rows"], ep_rows_SLD=ep_rows, decisions=rec, reshards=reshards,
                  reshard_steps=reshard_steps)


def _straggler(rows_SLD: np.ndarray) -> np.ndarray:
    rows = rows_SLD.astype(np.float64)
    mean = rows.mean(-1)
    return np.divide(rows.max(-1), mean, out=np.ones_like(mean), where=mean > 0)

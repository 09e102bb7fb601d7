"""Replay the runtime's pre-gating placements from a recorded trace (no communication).

Legend: S steps, L MoE layers, E experts, D ranks.

A trace records each iteration's ``tokens_ED``, not the placement. The runtime plans every
iteration's placement from its load predictor alone (``ShardedExperts.plan_placement``), and the
predictor sees exactly the recorded counts (training forwards, in order), so feeding the trace to
the same predictor and planner gives back the same placements and, through the same dispatcher,
the same rows per rank. That holds for the policies whose placement depends only on the predicted
loads (``fssdp`` with a fixed overlap degree and budget, ``ep``) and fixed owners; what the replay
cannot know is listed in :attr:`Replay.notes` (owners moved by re-sharding or SmartMoE, replicas
added after gating by calibration or FasterMoE, a measured "auto" overlap degree).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ds_fssdp.config import FSSDPConfig
from ds_fssdp.planner import (CostModel, ExpertShape, Hardware, LoadPredictor, PlacementOptions, dispatch,
                              homogeneous_owner, place_predicted)
from ds_fssdp.sim.traces import Trace
from ds_fssdp.topology import Topology

@dataclass
class ReplaySettings:
    policy: str = "fssdp"
    budget: int = 2
    overlap_degree: int = 4
    window: int = 5
    ranks_per_node: int | None = None  # None: one node
    placement: str = "joint"
    dispatch: str = "balanced"
    dispatch_slack: float = FSSDPConfig.model_fields["dispatch_slack"].default
    hardware: dict | None = None  # the run's cost model (placement "cost"): Hardware's fields
    expert_shape: dict | None = None  # and ExpertShape's
    notes: list = field(default_factory=list)

    def cost_model(self, topology: Topology) -> CostModel | None:
        if self.hardware is None or self.expert_shape is None:
            return None
        return CostModel(Hardware(**self.hardware), ExpertShape(**self.expert_shape), topology)

    @classmethod
    def from_trace(cls, trace: Trace, **overrides) -> "ReplaySettings":
        """Settings from the trace's sidecar (written by the runtime), then ``overrides`` (None: keep)."""
        meta = trace.meta
        s = cls()
        notes = []
        s.policy = str(meta.get("policy", s.policy))
        s.budget = int(meta.get("materialization_budget", s.budget))
        t = meta.get("overlap_degree", s.overlap_degree)
        if t == "auto":
            t = trace.num_experts
            notes.append('overlap_degree "auto" was measured per layer at run time; replayed as unlimited')
        s.overlap_degree = int(t)
        s.window = int(meta.get("load_window", s.window))
        s.ranks_per_node = meta.get("ranks_per_node")
        s.placement = str(meta.get("placement", s.placement))
        s.dispatch = str(meta.get("dispatch", s.dispatch))
        s.dispatch_slack = float(meta.get("dispatch_slack", s.dispatch_slack))
        s.hardware, s.expert_shape = meta.get("hardware"), meta.get("expert_shape")
        for key, value in overrides.items():
            if value is not None:
                setattr(s, key, value)
        if s.dispatch not in ("balanced", "paper"):
            notes.append(f"dispatch {s.dispatch!r} needs the run's cost model; replayed with 'balanced'")
            s.dispatch = "balanced"
        if s.placement == "cost" and (s.hardware is None or s.expert_shape is None):
            notes.append("placement 'cost' without the run's hardware in the trace; replayed as 'joint'")
        if int(meta.get("reshard_interval", 0) or 0) > 0 or s.policy == "smartmoe":
            notes.append("owners moved during the run (re-sharding / SmartMoE); shown with the initial owners")
        if meta.get("calibration") or s.policy == "fastermoe":
            notes.append("replicas added after gating (calibration / FasterMoE) are not in the trace; not shown")
        s.notes = notes
        return s


@dataclass
class Replay:
    settings: ReplaySettings
    owner_E: np.ndarray  # long [E], the same for every layer (homogeneous sharding)
    held_SLED: np.ndarray  # bool: rank d holds expert e (owner or replica) at step s in layer l
    rows_SLD: np.ndarray  # int64: rows (token, expert) rank d computes with those holders
    ep_rows_SLD: np.ndarray  # int64: the same with the owners alone (static EP)

    @property
    def notes(self) -> list:
        return self.settings.notes

    def replicas_SL(self) -> np.ndarray:
        return self.held_SLED.sum((2, 3)) - self.held_SLED.shape[2]

    def replica_frequency_LED(self) -> np.ndarray:
        """Fraction of iterations in which rank d held a replica (not the shard) of expert e."""
        owner_ED = np.zeros(self.held_SLED.shape[2:], dtype=bool)
        owner_ED[np.arange(owner_ED.shape[0]), self.owner_E] = True
        return (self.held_SLED & ~owner_ED).mean(0)

    def straggler_SL(self) -> np.ndarray:
        return _straggler(self.rows_SLD)

    def ep_straggler_SL(self) -> np.ndarray:
        return _straggler(self.ep_rows_SLD)


def replay(trace: Trace, settings: ReplaySettings | None = None) -> Replay:
    s = settings or ReplaySettings.from_trace(trace)
    S, L, E, D = trace.tokens_SLED.shape
    topology = Topology(num_ranks=D, ranks_per_node=int(s.ranks_per_node or D))
    owner_E = homogeneous_owner(E, D)
    cost = s.cost_model(topology)
    predictor = LoadPredictor([E] * L, window=s.window)
    held = np.zeros((S, L, E, D), dtype=bool)
    rows = np.zeros((S, L, D), dtype=np.int64)
    tokens = torch.from_numpy(trace.tokens_SLED.astype(np.int64))
    for step in range(S):
        for l in range(L):
            tokens_ED = tokens[step, l]
            placement_ED = _plan(s, owner_E, predictor, l, topology, cost)
            held[step, l] = placement_ED.numpy()
            plan_EDD = dispatch(placement_ED, tokens_ED, topology, mode=s.dispatch, slack=s.dispatch_slack)
            rows[step, l] = plan_EDD.sum((0, 1)).numpy()
            predictor.observe(l, tokens_ED)
    # Static EP: every owner computes all its experts' rows.
    ep_rows = np.zeros_like(rows)
    load_SLE = trace.tokens_SLED.sum(3, dtype=np.int64)
    for e, d in enumerate(owner_E.tolist()):
        ep_rows[:, :, d] += load_SLE[:, :, e]
    return Replay(settings=s, owner_E=owner_E.numpy(), held_SLED=held, rows_SLD=rows, ep_rows_SLD=ep_rows)


def _plan(s: ReplaySettings, owner_E, predictor, l, topology, cost) -> torch.Tensor:
    """ShardedExperts.plan_placement, on the replayed predictor: the same call of
    :func:`ds_fssdp.planner.place` (the main job's test checks the replayed replicas against the
    runtime's, step by step)."""
    config = PlacementOptions(placement=s.placement, overlap_degree=s.overlap_degree, materialization_budget=s.budget,
                              policy=s.policy)
    return place_predicted(predictor, l, owner_E, topology, config=config, cost=cost)


def _straggler(rows_SLD: np.ndarray) -> np.ndarray:
    rows = rows_SLD.astype(np.float64)
    mean = rows.mean(-1)
    return np.divide(rows.max(-1), mean, out=np.ones_like(mean), where=mean > 0)

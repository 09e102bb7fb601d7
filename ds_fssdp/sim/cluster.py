"""The simulator at cluster scale: groups of ranks, compact plans, steps generated as they are read.

Legend: S steps, L layers, E experts, D ranks of the world, B groups, N ranks of a group, n nodes
of a group.

``group_size`` N splits the world into B = D / N groups of consecutive ranks (N divides D and is
a multiple or a divisor of the ranks per node, so a group's nodes are its own). Under ``ep`` a
group is DeepSpeed's expert-parallel group (``ep_size``): one copy of every expert, homogeneous;
under ``fssdp`` / ``fssdp-rm`` an FSSDP group: owners inside the group, planning on the group's
own counts (its placement, calibration, dispatch and replicas), so groups' replicas differ. Ranks
at the same position in every group form the expert-data-parallel (EDP) group of the experts they
own: their gradients are all-reduced across groups with the dense all-reduce. Re-shards plan from
the loads summed over the world, so owners are the same in every group. Without ``group_size``
one group spans the world: the same numbers as :func:`ds_fssdp.sim.simulate.simulate` (tested).

Per iteration and policy, on top of :mod:`.simulate`'s accounting (its categories, its memory):

* an iteration is an optimizer step: ``Setup.gas`` micro-steps (trace rows), each planned and
  priced layer by layer (its replicas gathered and reduced), then the sync, the optimizer step and
  the re-shards after it, as the runtime's;
* groups run their layers independently and meet at the sync: a category's time is the slowest
  group's (the group with the longest layers over the step's micro-steps), plus the per-iteration
  parts (re-shard, the exposed sync of dense and EDP gradients, :mod:`.sync`; optimizer step);
* ``count_allgather_s``: the all-gather of ``tokens_ED`` inside each group before every layer's
  dispatch (a ring: every link carries (N - 1) E 8-byte counts; one latency), not in
  ``iteration_s``;
* ``planning_s``: CPU time of the policy's planning per iteration on one rank (its group's
  placement before gating, then calibration and dispatch after it), measured here (thread CPU
  time: other processes on the host do not inflate it) with the real planner (its C extension)
  at the group's size, not in ``iteration_s``;
* ``link_bytes``: bytes over each GPU's intra-node link and each node's inter-node link per
  iteration (busier direction), mean and max over the links, per category (a2a, spag, count, ar,
  rearr).

Layers are priced by :mod:`.pipeline` (the schedule; :data:`~.pipeline.SERIAL` is the accounting
before) as in :mod:`.simulate`, the gaps and windows per group.

Policies: ``ep``, ``uniform``, ``fsmoe`` (EP with FSMoE's schedule), ``fssdp``, ``fssdp-rm``
(:data:`CLUSTER_POLICIES`). EP's layers are
computed for all groups at once; FSSDP plans group by group with the compact dispatch
(:class:`~ds_fssdp.planner.plan.DispatchPlan`), never an [E, D, D] plan.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ds_fssdp.planner.baselines.ep import uniform_split
from ds_fssdp.planner.inputs import planner_inputs
from ds_fssdp.planner.dispatch import dispatch_plan
from ds_fssdp.planner.plan import DispatchPlan
from ds_fssdp.planner.layer import LayerPlanner, migrations
from ds_fssdp.planner.predict import LoadPredictor
from ds_fssdp.sim.bound import LowerBound
from ds_fssdp.planner.scheduled import ScheduledCostModel
from ds_fssdp.sim.links import Links, sparse_collective_links, traffic_BNN, traffic_links
from ds_fssdp.sim.pipeline import (INTER, INTRA, LayerSchedule, ScheduleOptions, binding_class, policy_options,
                                   scheduled_cost_model)
from ds_fssdp.sim.memory import budget_for_cap, ep_memory_bytes, optimizer_params, peak_state
from ds_fssdp.planner.materialize import materialize as algorithm1  # the default materializer
from ds_fssdp.sim.setup import MIGRATE_BYTES, OPT_TRAFFIC_BYTES, Setup, derive_overlap_degree, sim_settings
from ds_fssdp.sim.sync import dense_sync, expert_inputs, exposed_sync, sync_times
from ds_fssdp.planner.schedule import overlap_window, split_sync_pays
from ds_fssdp.planner.cost import CostModel
from ds_fssdp.sim.simulate import CATEGORIES, PolicyResult
from ds_fssdp.topology import Topology

CLUSTER_POLICIES = ("ep", "uniform", "fsmoe", "fssdp", "fssdp-rm")
LINK_CATEGORIES = ("a2a", "spag", "count", "ar", "rearr")
COUNT_BYTES = 8  # tokens_ED is gathered as int64


@dataclass
class ClusterResult(PolicyResult):
    group_size: int = 0
    count_allgather_s: float = 0.0
    planning_s: dict = field(default_factory=dict)  # pre_gating, post_gating: seconds per iteration, one rank
    link_bytes: dict = field(default_factory=dict)  # category -> {gpu_mean, gpu_max, node_mean, node_max}
    ep_memory_bytes: float = 0.0  # EP's fullest rank at this group size
    memory_cap: float | None = None
    overlap_degree: int = 0
    groups: int = 1
    groups_simulated: int = 1
    split_steps: float = 0.0  # share of the timed steps whose experts' all-gather ran in the next forward (sim/sync.py)

    @property
    def total_s(self) -> float:
        """Iteration with the count all-gather and the planning after gating (critical path)."""
        return self.iteration_s + self.count_allgather_s + self.planning_s.get("post_gating", 0.0)

    def to_dict(self) -> dict:
        out = super().to_dict()
        memory = sum(self.memory_bytes.values())
        out.update(iteration_s=self.iteration_s, memory_bytes=self.memory_bytes, group_size=self.group_size,
                   count_allgather_ms=1e3 * self.count_allgather_s,
                   planning_ms={k: 1e3 * v for k, v in self.planning_s.items()}, total_ms=1e3 * self.total_s,
                   link_bytes=self.link_bytes, memory_vs_ep=memory / self.ep_memory_bytes,
                   memory_cap=self.memory_cap, overlap_degree=self.overlap_degree, groups=self.groups,
                   groups_simulated=self.groups_simulated, split_steps=self.split_steps)
        return out


def check_group_size(group_size: int, topology: Topology) -> None:
    D, G = topology.num_ranks, topology.ranks_per_node
    if group_size < 1 or D % group_size or (group_size % G and G % group_size):
        raise ValueError(f"group_size ({group_size}) must divide the {D} GPUs and be a multiple or a divisor of "
                         f"the {G} GPUs per node")


class ClusterCostModel(CostModel):
    """The cost model, taking compact plans (what the cluster simulator's dispatcher
    returns; FSSDP's calibration prices its candidates with :meth:`layer_time`). ``scheduled``
    (placement by time): the planner's :class:`~ds_fssdp.planner.scheduled.ScheduledCostModel` of
    the layer schedule, which prices the plan's layer (forward + backward as its exchange runs, and
    its reduce's window) instead of the serial 4 exchanges + compute."""

    scheduled: ScheduledCostModel | None = None

    def layer_price(self, plan, attention_s: float | None = None) -> tuple:
        if self.scheduled is not None:
            return self.scheduled.layer_price(plan, attention_s)
        return super().layer_price(plan, attention_s)

    def layer_time(self, plan) -> float:
        return self.scheduled.layer_time(plan) if self.scheduled is not None else super().layer_time(plan)


def plan_links(plan: DispatchPlan, ranks_per_node: int, row_bytes: float) -> Links:
    fl = plan.flows_4F
    flows_4F = np.stack([np.zeros_like(fl[0]), fl[1], fl[2], fl[3]])
    return traffic_links(traffic_BNN(plan.tokens_ED[None], plan.holder_E[None], flows_4F),
                         ranks_per_node=ranks_per_node, row_bytes=row_bytes)


@dataclass
class StepAccounts:
    """One step's per-group accounts, filled layer by layer (:meth:`PolicyRun.step`)."""

    group_B: dict  # category -> seconds per group (the layers' parts)
    fb_B2: np.ndarray  # the layers' forward and backward (pipeline stages, sim/stages.py)
    ephemeral_BLN: np.ndarray  # replicas each rank holds per layer
    gaps_BL: np.ndarray  # the link gaps of each layer's backward, and of its forward
    fgaps_BL: np.ndarray
    idle_B: np.ndarray  # the previous layer's forward time its gather link is free
    layer_degrees: list

    @classmethod
    def empty(cls, B: int, L: int, N: int) -> "StepAccounts":
        return cls({c: np.zeros(B) for c in CATEGORIES}, np.zeros((B, 2)), np.zeros((B, L, N)), np.zeros((B, L)),
                   np.zeros((B, L)), np.zeros(B), [])


class PolicyRun:
    """One policy at one group size, fed the world's ``tokens_LED`` step by step."""

    def __init__(self, name: str, setup: Setup, *, group_size: int | None = None, budget: int | None = None,
                 memory_cap: float | None = None, overlap_degree: int | None = None, max_groups: int | None = None,
                 dispatcher=None, materializer=algorithm1, decisions: list | None = None,
                 schedule: ScheduleOptions | None = None, degrees: list | None = None):
        """``overlap_degree`` None: t derived for the group (a group inside one node gathers over
        the intra-node links) and, under the idle-link schedule, per layer and group from the
        window the last step left it (:class:`~ds_fssdp.planner.baselines.Clock`); given: fixed.
        ``budget`` None: the setup's m, or the ``memory_cap``'s.
        ``max_groups``: simulate only the first this many groups (their layers, planning, memory;
        the all-reduce still spans every group). For traces whose groups are alike (the synthetic
        ones), a cheaper estimate that can only miss a slower group among the others. ``decisions``:
        a list that gets, per step, the first group's ``(owner_E, placed_ED, held_ED)`` per layer
        (planned policies; what the runtime records as ``decision_owner/placed/held``).
        ``schedule``: FSSDP's :class:`~ds_fssdp.sim.pipeline.ScheduleOptions` (default: all on;
        ``fsmoe`` takes its degree option, EP and Uniform run serially). ``degrees``: a list that
        gets, per step, each layer's (forward, backward) degree per simulated group."""
        if name not in CLUSTER_POLICIES:
            raise ValueError(f"policy ({name!r}) must be one of {CLUSTER_POLICIES} at cluster scale")
        D, G = setup.topology.num_ranks, setup.topology.ranks_per_node
        N = D if group_size is None else group_size
        check_group_size(N, setup.topology)
        if name in ("ep", "uniform", "fsmoe") and N > setup.num_experts:
            raise ValueError(f"{name}: group_size ({N}) must be <= the {setup.num_experts} experts (DeepSpeed's "
                             f"ep_size divides the experts)")
        if max_groups is not None and max_groups < 1:
            raise ValueError(f"max_groups ({max_groups}) must be >= 1 or None")
        self.name, self.setup, self.N, self.groups = name, setup, N, D // N
        self.B = self.groups if max_groups is None else min(self.groups, max_groups)  # groups simulated
        self.topo = Topology(num_ranks=N, ranks_per_node=min(G, N))
        self.cost = ClusterCostModel(setup.hw, setup.shape, self.topo)
        self.rm = name == "fssdp-rm"
        if memory_cap is not None:
            if budget is not None:
                raise ValueError("give a budget or a memory_cap, not both")
            budget = budget_for_cap(setup, N, memory_cap, rematerialize=self.rm)
        self.budget = budget if budget is not None else (setup.budget_rm if self.rm else setup.budget)
        self.memory_cap = memory_cap
        attn_f = setup.attention_fwd_s
        self.fixed_t = overlap_degree is not None
        if overlap_degree is None:
            overlap_degree = derive_overlap_degree(setup.hw, self.topo, setup.shape, attention_s=attn_f)
        self.overlap_degree = overlap_degree
        self.options = policy_options(name, schedule)
        dispatcher = dispatcher or functools.partial(dispatch_plan, mode="paper")
        self.inputs = planner_inputs(sim_settings(name, setup, budget=self.budget,
                                                  by_window=self.options.idle_link and not self.fixed_t,
                                                  t_by_time=self.options.t_by_time, overlap_degree=overlap_degree),
                                     num_experts_L=[setup.num_experts] * setup.num_layers, topology=self.topo,
                                     cost=self.cost, dispatcher=dispatcher, materializer=materializer)
        self.policy = self.inputs.policy
        self.sched = LayerSchedule(setup.hw, setup.shape, ranks_per_node=self.topo.ranks_per_node,
                                   top_k=setup.top_k, options=self.options, two_hops=lambda: self.inputs.two_hops,
                                   side_ratio=setup.side_ratio)
        if self.options.price_by_schedule:
            self.cost.scheduled = scheduled_cost_model(setup.hw, setup.shape, self.topo, self.sched)
        self.gather_class = INTER if self.topo.num_nodes > 1 else INTRA
        self.window_BL = np.full((self.B, setup.num_layers), attn_f)  # replica gather windows (last step's)
        self.degree_log = degrees
        self.degree_counts = ({}, {})
        self.dedup_saved = 0.0
        self.planned = name.startswith("fssdp")
        self.deepspeed_moe = name in ("ep", "uniform")  # DeepSpeed's MoE: its engine syncs the experts (sim/sync.py)
        L, E, B = setup.num_layers, setup.num_experts, self.B
        self.owner_LE = self.policy.initial_owner()
        # Each group plans like the runtime's stage of that group: its own predictor of its own
        # tokens_ED, the same LayerPlanner; re-shards plan from the world's loads.
        self.planners_BL = [[LayerPlanner(self.policy, p, l) for l in range(L)]
                            for p in (LoadPredictor([E] * L, window=setup.load_window)
                                      for _ in range(B if self.planned else 0))]
        self.world_predictor = LoadPredictor([E] * L, window=setup.load_window)
        self.observed = 0
        self._sync_cache = {}  # split -> SyncTimes (the sync's links)
        self._ring_memo = {}  # the EDP ring's seconds per (bytes, collective)
        self._dense_s = dense_sync(setup)
        self._split = False  # this step's experts' sync split around the step (decided after the last)
        self._glob, self._group_sum = {}, {}  # the optimizer step's accounts so far (its micro-steps')
        self.split_steps = 0
        self.count_links = self._count_links()
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.links = {}  # category -> [bytes per GPU link, per node link] (the simulated groups', or the world's)
        self.step_s, self.straggler, self.inter_bytes, self.replicas = [], [], 0.0, 0.0
        self.count_s, self.plan_pre_s, self.plan_post_s = 0.0, 0.0, 0.0
        self.migrated, self.counted, self.peak_total, self.peak_memory = 0, 0, -1.0, {}
        self.micro_counted = 0  # timed micro-steps (trace rows); ``counted``: timed optimizer steps
        self.decisions = decisions

    # -- per step ----------------------------------------------------------------------------------
    def step(self, s: int, tokens_LED: np.ndarray) -> None:
        """Trace row ``s``: one micro-step. Every ``Setup.gas``-th closes an optimizer step (the
        sync, the optimizer step), and the re-shards follow it, before the next micro-step, as the
        runtime's (its step count: ``s // gas``)."""
        tokens_LED = self._route(tokens_LED)
        st = self.setup
        timed, boundary = st.timed(s), st.boundary(s)
        if s % st.gas == 0:
            self._glob, self._group_sum = dict.fromkeys(CATEGORIES, 0.0), dict.fromkeys(CATEGORIES, 0.0)
            self._glob["rearr"] += self._reshard(s // st.gas)
        glob = self._glob
        acc = StepAccounts.empty(self.B, st.num_layers, self.N)
        sync = self._sync(self._split)
        ar_class = binding_class(sync.links, st.hw) if self.options.grad_gaps else INTER
        for l in range(st.num_layers):
            self._layer(l, tokens_LED, acc, ar_class, timed)
        if self.degree_log is not None:
            self.degree_log.append(acc.layer_degrees)
        glob["comp"] += st.extra_compute_s  # every micro-step's dense layers
        for c in CATEGORIES:
            self._group_sum[c] = self._group_sum[c] + acc.group_B[c]
        owned_N = np.bincount(self.owner_LE.numpy().ravel(), minlength=self.N).astype(np.float64) * st.shape.params
        self._memory(owned_N, acc.ephemeral_BLN)
        if timed:
            self.micro_counted += 1
            self.count_s += st.num_layers * float(self.count_links.time_B(st.hw)[0])
        if boundary:
            slowest = self._close_step(glob, acc, owned_N, timed)
            if timed:
                self.counted += 1
                self._add_links("ar", sync.links, 1.0)
                step = {c: self._group_sum[c][slowest] + glob[c] for c in CATEGORIES}
                for c in CATEGORIES:
                    self.totals[c] += step[c]
                self.step_s.append(sum(step.values()))
        self._observe(tokens_LED)

    def _layer(self, l: int, tokens_LED: np.ndarray, acc: StepAccounts, ar_class: int, timed: bool) -> None:
        """Layer ``l`` of every simulated group: planned (or EP's / Uniform's holders), priced by
        the schedule, its replicas' gather and reduce charged past their windows; the gaps and
        windows it leaves go to ``acc``."""
        st = self.setup
        L, E, N, B = st.num_layers, st.num_experts, self.N, self.B
        attn_f = st.attention_fwd_s
        attn_b = 2.0 * attn_f
        group_B = acc.group_B
        tokens_BEN = tokens_LED[l].reshape(E, self.groups, N)[:, :B].transpose(1, 0, 2)
        window_B = np.array([overlap_window(attn_f, float(i), early=self.options.idle_link) for i in acc.idle_B])
        if self.planned:
            holder_BE, flows_4F, spag = self._plan_layer(l, tokens_BEN, acc.ephemeral_BLN, timed)
        else:
            holder_BE, flows_4F, spag = np.broadcast_to(self.owner_LE.numpy()[l], (B, E)), None, None
        lt = self.sched.layer(traffic_BNN(tokens_BEN, holder_BE, flows_4F))
        moe_B = lt.moe_B
        group_B["comp"] += attn_f + attn_b + moe_B + lt.side_B
        group_B["a2a"] += lt.forward_B + lt.backward_B - moe_B - lt.side_B
        acc.fb_B2 += np.stack([attn_f + lt.forward_B, attn_b + lt.backward_B], 1)
        reduce_hidden_B = np.zeros(B)
        gather_here_B = gather_before_B = np.zeros(B)  # hidden gather: in this layer's span, in the one before
        if spag is not None:
            reduce_hidden_B, gather_here_B, gather_before_B = self._charge_replicas(spag, lt, window_B, ar_class,
                                                                                    group_B)
        if self.options.idle_link:
            acc.idle_B = np.maximum(0.0, lt.forward_B - lt.busy_forward_B2[:, self.gather_class])
            if l + 1 < L:
                self.window_BL[:, l + 1] = [overlap_window(attn_f, float(i)) for i in acc.idle_B]
        acc.gaps_BL[:, l] = attn_b + lt.backward_B - lt.busy_backward_B2[:, ar_class] - reduce_hidden_B
        acc.fgaps_BL[:, l] = attn_f + lt.forward_B - lt.busy_forward_B2[:, ar_class] - gather_here_B
        if l:
            acc.fgaps_BL[:, l - 1] -= gather_before_B
        acc.layer_degrees.append(lt.degrees)
        if timed:
            self._count_layer(lt)

    def _charge_replicas(self, spag: tuple, lt, window_B: np.ndarray, ar_class: int, group_B: dict) -> tuple:
        """[spag]: the replicas' gather past its window, the reduce (twice under re-materialization)
        past the backward's, calibration's gather whole. Returns what of the reduce, and of the
        gather in this layer's span and the one before, sits on the sync's links (0 elsewhere)."""
        hw, attn_f = self.setup.hw, self.setup.attention_fwd_s
        B = window_B.shape[0]
        gather, reduce, calib, times = spag
        window_b_B = (self.sched.reduce_windows(lt, attn_f, across_nodes=self.gather_class == INTER)
                      if self.options.idle_link else 2.0 * attn_f)
        # Nothing to gather costs 0, hence max(0, 0 - window) = 0: the paper engine's "if any" is implied.
        group_B["spag"] += np.maximum(0.0, gather.time_B(hw) - window_B)
        group_B["spag"] += np.maximum(0.0, reduce.time_B(hw) * times - window_b_B)
        group_B["spag"] += calib.time_B(hw)
        reduce_hidden_B = np.zeros(B)
        gather_here_B = gather_before_B = np.zeros(B)
        if self.gather_class == ar_class:  # the replica gather and reduce share the sync's links
            reduce_hidden_B = np.minimum(reduce.time_B(hw) * times, window_b_B)
            hidden_B = np.minimum(gather.time_B(hw), window_B)  # from the window's start
            gather_before_B = np.minimum(hidden_B, window_B - attn_f)
            gather_here_B = hidden_B - gather_before_B
        return reduce_hidden_B, gather_here_B, gather_before_B

    def _count_layer(self, lt) -> None:
        """A timed layer's links, straggler, inter-node bytes, dedup savings and degrees."""
        exchange, rows_BN = lt.links, lt.links.rows_BN
        self._add_links("a2a", exchange, 4.0)
        self._add_links("count", self.count_links, 1.0)
        mean = float(rows_BN.mean())
        self.straggler.append(float(rows_BN.max()) / mean if mean > 0 else 1.0)
        self.inter_bytes += 4.0 * exchange.inter_total
        self.dedup_saved += 4.0 * lt.saved_bytes / self.B
        for b_deg in lt.degrees:
            for counts, deg in zip(self.degree_counts, b_deg):
                counts[deg] = counts.get(deg, 0) + 1

    def _close_step(self, glob: dict, acc: StepAccounts, owned_N: np.ndarray, timed: bool) -> int:
        """The optimizer step's own parts into ``glob`` (the exposed sync, the optimizer step) after
        its last micro-step ``acc``, the runtime's split decision for the next step, and the slowest
        group's phases. Returns the slowest group (over the step's micro-steps: the groups meet at
        the sync)."""
        st, hw, N = self.setup, self.setup.hw, self.N
        slowest = int(np.argmax(sum(self._group_sum.values())))
        # The experts' sync from the runtime's inputs (sim/sync.py): with the gaps, each layer's reduce
        # issued after its backward on the boundary micro-step, sent in the gaps below; its all-gather
        # (split, or ZeRO 1) before its first use in the next forward (its replica gather, a layer ahead,
        # under FSSDP), in the forward's gaps. DeepSpeed's dense collectives after the backward.
        split = self._split or st.zero_stage >= 1
        if self.deepspeed_moe:  # DeepSpeed's: the experts after the dense gradients, after the backward
            sync, experts = self._sync(split), None
            glob["ar"] += exposed_sync(sync.step_gather_s + sync.reduce_s + sync.forward_gather_s, None,
                                       gaps=False, split=split, lead=0)
        else:
            experts = expert_inputs(st, N, self.owner_LE.numpy(), acc.gaps_BL[slowest], acc.fgaps_BL[slowest],
                                    memo=self._ring_memo)
            glob["ar"] += exposed_sync(self._dense_s, experts, gaps=self.options.grad_gaps, split=split,
                                       lead=1 if self.planned else 0)
        # the experts' all-gather ran in the next forward (EP and Uniform gather at the step)
        self.split_steps += int(timed and experts is not None and split and self.options.grad_gaps)
        if self.planned and self.options.grad_gaps and st.zero_stage == 0 and experts is not None:
            # The runtime's decision for the next step (ZeRO 0: the experts' all-reduce whole, or split
            # with each layer updated where its summed gradients land), from this step's gaps.
            self._split = split_sync_pays(*experts, lead=1)
        glob["opt"] += float(optimizer_params(st, owned_N, N).max()) * OPT_TRAFFIC_BYTES / hw.hbm_bw
        # the slowest group's forward and backward and the iteration's own parts, per step (sim/stages.py)
        self.phases = dict(glob, forward=float(acc.fb_B2[slowest, 0]), backward=float(acc.fb_B2[slowest, 1]),
                           spag=float(acc.group_B["spag"][slowest]))
        return slowest

    def _plan_layer(self, l: int, tokens_BEN: np.ndarray, ephemeral_BLN: np.ndarray, timed: bool):
        """Plan layer ``l`` group by group (the policy, timed): the holders, the flows and the
        sparse collectives' links (gather, reduce, calibration, reduce repeats) of all groups."""
        st = self.setup
        B, N, E, G = self.B, self.N, st.num_experts, self.topo.ranks_per_node
        psi = float(st.shape.expert_bytes)
        owner_E = self.owner_LE[l]
        holder_BE = np.empty((B, E), dtype=np.int64)
        hidden_BEN = np.empty((B, E, N), dtype=bool)
        calibrated_BEN = np.empty((B, E, N), dtype=bool)
        gathered_BEN = np.empty((B, E, N), dtype=bool)
        flows = []
        for b in range(B):
            tokens_ED = torch.from_numpy(np.ascontiguousarray(tokens_BEN[b], dtype=np.int64))
            planner = self.planners_BL[b][l]
            t0 = time.thread_time()
            # t from the window the last step's schedule left (or the fixed t)
            clock = self.inputs.clock_rule.clock(float(self.window_BL[b, l]), self.setup.attention_fwd_s)
            placement_ED, overlap_t = planner.pre_gating_t(owner_E, clock)
            t1 = time.thread_time()
            lp = planner.post_gating(owner_E, placement_ED, tokens_ED, clock, overlap_t=overlap_t)
            plan = planner.dispatch(lp, tokens_ED)
            t2 = time.thread_time()
            if self.decisions is not None and b == 0:
                if l == 0:
                    self.decisions.append([])
                self.decisions[-1].append((owner_E.clone(), placement_ED.clone(), lp.placement_ED.clone()))
            if timed:
                self.plan_pre_s += (t1 - t0) / B
                self.plan_post_s += (t2 - t1) / B
            holder_BE[b] = plan.holder_E
            x, h, d, k = plan.flows_4F
            flows.append(np.stack([np.full_like(x, b), h, d, k]))
            hidden_BEN[b], calibrated_BEN[b] = lp.hidden_ED.numpy(), lp.calibrated_ED.numpy()
            gathered_BEN[b] = lp.gathered_ED.numpy()  # what calibration evicted was gathered too
            ephemeral_BLN[b, l] = (lp.hidden_ED | lp.calibrated_ED | lp.shadow_ED).sum(0).numpy()
        owner_np = owner_E.numpy()
        shard_EN = np.zeros((E, N), dtype=bool)
        shard_EN[np.arange(E), owner_np] = True
        relay = self.inputs.relay
        gather = sparse_collective_links(owner_np, shard_EN | gathered_BEN, ranks_per_node=G, chunk_bytes=psi,
                                         relay=relay)
        reduce = sparse_collective_links(owner_np, shard_EN | hidden_BEN | calibrated_BEN, ranks_per_node=G,
                                         chunk_bytes=psi, relay=relay)
        calib = sparse_collective_links(owner_np, shard_EN | calibrated_BEN, ranks_per_node=G, chunk_bytes=psi,
                                        relay=relay)
        times = 2.0 if self.rm else 1.0
        if timed:
            self.replicas += float(ephemeral_BLN[:, l].sum()) / st.num_layers / B
            self._add_links("spag", Links(gather.rank_BN + times * reduce.rank_BN + calib.rank_BN,
                                          gather.node_Bn + times * reduce.node_Bn + calib.node_Bn), 1.0)
        return holder_BE, np.concatenate(flows, 1), (gather, reduce, calib, times)

    # -- pieces ------------------------------------------------------------------------------------
    def _route(self, tokens_LED: np.ndarray) -> np.ndarray:
        """The tokens the gate dispatches (the policy's ``route``): Uniform rewrites every group's,
        and its predictors and re-shards see the rewritten loads, as the runtime's."""
        if self.name != "uniform":
            return tokens_LED
        L, E, D = tokens_LED.shape
        groups_BEN = tokens_LED.reshape(L, E, self.groups, self.N).transpose(0, 2, 1, 3).reshape(-1, E, self.N)
        routed = uniform_split(groups_BEN).reshape(L, self.groups, E, self.N).transpose(0, 2, 1, 3)
        return np.ascontiguousarray(routed.reshape(L, E, D))

    def _observe(self, tokens_LED: np.ndarray) -> None:
        L, E = tokens_LED.shape[:2]
        load_LE = tokens_LED.sum(2, dtype=np.int64)
        if self.planned:
            tokens_LEBN = tokens_LED.reshape(L, E, self.groups, self.N)
            for b, planners in enumerate(self.planners_BL):
                for l, planner in enumerate(planners):
                    planner.observe(torch.from_numpy(np.ascontiguousarray(tokens_LEBN[l, :, b], dtype=np.int64)))
        for l in range(L):
            self.world_predictor.observe(l, torch.from_numpy(load_LE[l]))  # for re-shards (FSSDP's only)
        self.observed += 1

    def _reshard(self, s: int) -> float:
        if not self.observed or not self.inputs.migrators:
            return 0.0
        # the first group's windows: every group re-shards alike (the runtime's agreed windows)
        clock = self.inputs.clock_rule.reshard_clock(list(self.window_BL[0]),
                                                     [self.setup.attention_fwd_s] * self.setup.num_layers)
        done = migrations(self.inputs.migrators, s, self.world_predictor.predict_all(), self.owner_LE, clock=clock)
        if not done:
            return 0.0
        self.owner_LE = done[-1].owner_LE
        copies = torch.cat([r.copies_M4 for r in done])
        if not copies.shape[0]:
            return 0.0
        N, P = self.N, self.setup.shape.params
        traffic_DD = torch.zeros(N * N, dtype=torch.float64).index_add_(
            0, copies[:, 2] * N + copies[:, 3],
            torch.full((copies.shape[0], ), float(MIGRATE_BYTES * P), dtype=torch.float64)).view(N, N)
        self.migrated += copies.shape[0] * self.groups
        self._sync_cache = {}
        return self.cost.transfer_time(traffic_DD)

    def _count_links(self) -> Links:
        """One layer's all-gather of the counts in every group."""
        N, G, B = self.N, self.topo.ranks_per_node, self.B
        moved = float((N - 1) * self.setup.num_experts * COUNT_BYTES)
        nodes = N // G
        return Links(np.full((B, N), moved), np.full((B, nodes), moved if nodes > 1 else 0.0))

    def _sync(self, split: bool):
        """The step's sync at the owners (:func:`~ds_fssdp.sim.sync.sync_times`): its links and
        the link class it binds on; ``split`` (ZeRO 0): the experts' all-reduce split around the step."""
        if split not in self._sync_cache:
            owned_N = np.bincount(self.owner_LE.numpy().ravel(), minlength=self.N).astype(np.float64)
            self._sync_cache[split] = sync_times(self.setup, self.N, owned_N, split_experts=split)
        return self._sync_cache[split]

    def _memory(self, owned_N: np.ndarray, ephemeral_BLN: np.ndarray) -> None:
        total, parts = peak_state(self.setup, owned_N, ephemeral_BLN, rm=self.rm, group_size=self.N)
        if total > self.peak_total:
            self.peak_total, self.peak_memory = total, parts

    def _add_links(self, category: str, links: Links, times: float) -> None:
        """Add ``times`` x ``links`` to the category's link totals: per simulated group (rows b of
        [B, N] and [B, n]) or the world's own (one row of D ranks and all nodes)."""
        rank, node = links.rank_BN.ravel(), links.node_Bn.ravel()
        if self.N < self.setup.topology.ranks_per_node and links.rank_BN.shape[0] > 1:
            node = np.zeros(0)  # groups inside one node: no inter-node link of their own
        if category not in self.links:
            self.links[category] = [np.zeros_like(rank), np.zeros_like(node)]
        self.links[category][0] += rank * times
        self.links[category][1] += node * times

    def result(self) -> ClusterResult:
        c = max(1, self.counted)
        link_bytes = {}
        for cat in LINK_CATEGORIES:
            rank_D, node_W = self.links.get(cat, (np.zeros(1), np.zeros(1)))
            node_W = node_W if node_W.size else np.zeros(1)
            link_bytes[cat] = {"gpu_mean": float(rank_D.mean()) / c, "gpu_max": float(rank_D.max()) / c,
                               "node_mean": float(node_W.mean()) / c, "node_max": float(node_W.max()) / c}
        return ClusterResult(policy=self.name, iteration_s=sum(self.totals.values()) / c,
                             breakdown_s={k: v / c for k, v in self.totals.items()}, memory_bytes=self.peak_memory,
                             straggler=float(np.mean(self.straggler)), inter_node_gb=self.inter_bytes / c / 1e9,
                             replicas_per_layer=self.replicas / max(1, self.micro_counted),
                             migrated_experts=self.migrated,
                             budget=self.budget, step_s=self.step_s, group_size=self.N,
                             count_allgather_s=self.count_s / c,
                             planning_s={"pre_gating": self.plan_pre_s / c, "post_gating": self.plan_post_s / c},
                             link_bytes=link_bytes, ep_memory_bytes=ep_memory_bytes(self.setup, self.N),
                             memory_cap=self.memory_cap, overlap_degree=self.overlap_degree, groups=self.groups,
                             groups_simulated=self.B,
                             degrees={"forward": dict(sorted(self.degree_counts[0].items())),
                                      "backward": dict(sorted(self.degree_counts[1].items()))},
                             dedup_saved_gb=self.dedup_saved / c / 1e9, split_steps=self.split_steps / c)


def run_cluster(runs: list, source, *, bound: bool = True) -> list:
    """Feed every step of ``source`` (an iterable of ``tokens_LED``: a [S, L, E, D] array, or a
    :class:`~ds_fssdp.sim.loadcv.LoadCVSource`) to every run in turn; their results, each with
    the workload's :class:`~ds_fssdp.sim.bound.LowerBound` (the least over the runs' group sizes,
    with the most replicas any run may hold) as ``lower_bound_s`` (none under gradient
    accumulation: the bound prices one micro-step per optimizer step)."""
    bounds = []
    if bound and runs and runs[0].setup.gas == 1:
        budget = max([r.budget for r in runs if r.planned], default=0)
        # past the most a run holds without re-materializing, the reduce runs twice (fssdp-rm)
        plain = max([r.budget for r in runs if r.planned and not r.rm], default=0)
        shapes = dict.fromkeys((r.N, r.B) for r in runs)  # runs of one group shape share a bound
        bounds = [LowerBound(runs[0].setup, group_size=N, budget=budget, groups=B, plain=plain) for N, B in shapes]
    steps = 0
    for s, tokens_LED in enumerate(source):
        tokens_LED = np.asarray(tokens_LED)
        for run in runs:
            run.step(s, tokens_LED)
        for b in bounds:
            b.step(s, tokens_LED)
        steps += 1
    if runs and steps < runs[0].setup.rows_needed:
        st = runs[0].setup
        raise ValueError(f"the trace has {steps} steps; the simulation needs {st.rows_needed}: one whole optimizer "
                         f"step ({st.gas} rows) after the load window ({st.load_window})")
    results = [run.result() for run in runs]
    if bounds:
        low = min(b.result() for b in bounds)
        for r in results:
            r.lower_bound_s = low
    return results


def simulate_cluster(setup: Setup, source, policies, *, group_size: int | None = None,
                     memory_cap: float | None = None, overlap_degree: int | None = None,
                     max_groups: int | None = None, dispatcher=None, materializer=algorithm1,
                     schedule: ScheduleOptions | None = None) -> list:
    """One :class:`ClusterResult` per policy name, in order, each at ``group_size`` (the world
    if None), EP's and Uniform's at most at the expert count (the group EP runs; its result says
    which; ``fsmoe`` like EP). See :class:`PolicyRun` for the rest (``schedule``)."""
    N = setup.topology.num_ranks if group_size is None else group_size
    runs = [PolicyRun(name, setup, group_size=N if name.startswith("fssdp") else min(N, setup.num_experts),
                      memory_cap=memory_cap if name.startswith("fssdp") else None, overlap_degree=overlap_degree,
                      max_groups=max_groups, dispatcher=dispatcher, materializer=materializer, schedule=schedule)
            for name in policies]
    return run_cluster(runs, source)

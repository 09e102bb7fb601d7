"""The simulator: a routing trace replayed through each policy, group by group, each optimizer
step's critical path charged (seconds; Figure 11's categories in brackets), with the memory
(Figure 12) and the links.

Legend: S steps, L layers, E experts, D ranks of the world, B groups, N ranks of a group, n nodes
of a group.

A trace row is a micro-step: per layer ``pre_gating`` (placement from the sliding-window
prediction), ``route``, ``post_gating``, the dispatch, then the predictor observes the routed loads
(Uniform's even ones). Every ``Setup.gas``-th row closes an optimizer step (an iteration) and the
re-shards follow it, as the runtime's. Per layer:

* [comp] attention forward T_attn = tokens x (8 d^2 + 2 S d) / FLOP/s and backward 2 T_attn; the
  slowest rank's expert compute, rows x 2 x params x 3 / FLOP/s (a backward of twice the forward).
* [a2a] what the token exchanges add to it under the layer schedule (:mod:`.pipeline`: FSSDP's,
  ``fsmoe``'s, or :data:`~.pipeline.SERIAL`'s four exchanges, each bound by its busiest link, as the
  published baselines run), over the bytes left by one copy per destination.
* [spag] the replicas' SparseAllGather (calibration's evictions included) past its window (the
  attention forward, with the idle link plus what layer l - 1's forward leaves the gather's link
  class; t comes from the last step's window through the :class:`~ds_fssdp.planner.baselines.Clock`),
  their SparseReduceScatter (twice under fssdp-rm) past the backward's, calibration's gather whole;
  priced as the runtime moves them (``planner/inputs.py``).
* [rearr] FasterMoE's broadcast of its shadows (:meth:`CostModel.broadcast_time`); [ar] their
  reduce (as long) and FlexMoE's ring all-reduce of its replicas, exposed (after the backward).

Per optimizer step: [comp] ``Setup.extra_compute_s`` per micro-step; [rearr] the re-shards' copies
(SmartMoE's, FlexMoE's, FSSDP's Algorithm 2: 14 bytes per parameter, :meth:`CostModel.transfer_time`);
[ar] the sync (:mod:`.sync`: DeepSpeed's dense collectives after the backward, the experts' over
their EDP groups, in the backward's link gaps for FSSDP and fsmoe); [opt] the busiest rank's step,
28 bytes of HBM traffic per parameter it updates (dense, owned, FlexMoE's replicas; ZeRO 1 slices).

``group_size`` N: B = D / N groups of consecutive ranks (N divides D and is a multiple or a divisor
of the ranks per node). Under ``ep`` a group is DeepSpeed's expert-parallel group; under FSSDP a
group plans on its own counts. Ranks at one position in every group are the EDP group of the experts
they own. Re-shards plan from the world's loads (owners alike in every group); groups meet at the
sync, where a category's time is the slowest group's. Without ``group_size`` one group spans the
world (the paper's report, :func:`simulate`); FasterMoE, SmartMoE and FlexMoE run only so, at ZeRO 0.
Beside ``iteration_s``: ``count_allgather_s`` (each layer's all-gather of ``tokens_ED`` in its
group: a ring, one latency), ``planning_s`` (thread CPU time of the real planner per iteration on one
rank, before and after gating), ``link_bytes`` (per GPU and node link per iteration, per category).

Memory per rank: :func:`~.memory.peak_state` (:mod:`.memory` states the bytes) at the peak rank and
step. Averages are over the optimizer steps after the predictor's first window.
Each result carries the workload's lower bound (:mod:`.bound`; none under gradient accumulation).
Not modelled: contention of overlapped collectives with the exchanges or the dense sync, the gate,
norms and element-wise work (alike for every policy).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from ds_fssdp.planner.baselines import POLICY_NAMES
from ds_fssdp.planner.baselines.ep import uniform_split
from ds_fssdp.planner.cost import CostModel
from ds_fssdp.planner.dispatch import dispatch_plan
from ds_fssdp.planner.inputs import planner_inputs
from ds_fssdp.planner.layer import LayerPlanner, migrations
from ds_fssdp.planner.materialize import materialize as algorithm1  # the default materializer
from ds_fssdp.planner.plan import DispatchPlan
from ds_fssdp.planner.schedule import overlap_window, split_sync_pays
from ds_fssdp.planner.scheduled import ScheduledCostModel
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.sim.bound import LowerBound
from ds_fssdp.sim.foresight import make_predictor
from ds_fssdp.sim.links import Links, sparse_collective_links, traffic_BNN, traffic_links
from ds_fssdp.sim.memory import budget_for_cap, ep_memory_bytes, optimizer_params, peak_state
from ds_fssdp.sim.pipeline import INTER, INTRA, LayerSchedule, ScheduleOptions, binding_class, policy_options
from ds_fssdp.sim.report import CATEGORIES, ClusterResult
from ds_fssdp.sim.setup import MIGRATE_BYTES, OPT_TRAFFIC_BYTES, Setup, derive_overlap_degree, sim_settings
from ds_fssdp.sim.sync import dense_sync, expert_inputs, exposed_sync, sync_times
from ds_fssdp.topology import Topology

CLUSTER_POLICIES = ("ep", "uniform", "fsmoe", "fssdp", "fssdp-rm")
SIM_POLICY_NAMES = POLICY_NAMES + ("fsmoe", )  # the planner's policies and FSMoE's schedule over EP
EP_HOLDERS = ("ep", "uniform", "fsmoe")  # nothing planned: every expert at its owner
LINK_CATEGORIES = ("a2a", "spag", "count", "ar", "rearr")
COUNT_BYTES = 8  # tokens_ED is gathered as int64


@dataclass
class LayerCharge:
    """What one layer's MoE part was charged (seconds; the first group's): ``moe_s`` its exchanges and
    the slowest rank's compute (forward + backward, [comp] + [a2a]), and in [spag] the hidden gather
    past ``window_s``, the reduce (twice under re-materialization) past ``backward_window_s`` and
    calibration's gather."""
    moe_s: float
    window_s: float
    backward_window_s: float
    gather_s: float = 0.0
    reduce_s: float = 0.0
    calibration_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.moe_s + self.gather_s + self.reduce_s + self.calibration_s


def check_group_size(group_size: int, topology: Topology) -> None:
    D, G = topology.num_ranks, topology.ranks_per_node
    if group_size < 1 or D % group_size or (group_size % G and G % group_size):
        raise ValueError(f"group_size ({group_size}) must divide the {D} GPUs and be a multiple or a divisor of "
                         f"the {G} GPUs per node")


def _check_run(name: str, setup: Setup, N: int, max_groups: int | None) -> None:
    D = setup.topology.num_ranks
    if name not in SIM_POLICY_NAMES:
        raise ValueError(f"policy ({name!r}) must be one of {SIM_POLICY_NAMES}")
    check_group_size(N, setup.topology)
    if name not in CLUSTER_POLICIES and (N != D or setup.zero_stage != 0):
        raise ValueError(f"{name} at group_size ({N}) and zero_stage ({setup.zero_stage}): the paper's baselines "
                         f"run on one group of all {D} GPUs at ZeRO 0; at cluster scale one of {CLUSTER_POLICIES}")
    if name in EP_HOLDERS and N > setup.num_experts:
        raise ValueError(f"{name}: group_size ({N}) must be <= the {setup.num_experts} experts (DeepSpeed's "
                         f"ep_size divides the experts)")
    if max_groups is not None and max_groups < 1:
        raise ValueError(f"max_groups ({max_groups}) must be >= 1 or None")


def _log_layer(log: list | None, l: int, item) -> None:
    """Append layer ``l``'s ``item`` to ``log``'s current step (a new one at layer 0)."""
    if log is not None:
        if l == 0:
            log.append([])
        log[-1].append(item)


def plan_links(plan: DispatchPlan, ranks_per_node: int, row_bytes: float) -> Links:
    fl = plan.flows_4F
    flows_4F = np.stack([np.zeros_like(fl[0]), fl[1], fl[2], fl[3]])
    return traffic_links(traffic_BNN(plan.tokens_ED[None], plan.holder_E[None], flows_4F),
                         ranks_per_node=ranks_per_node, row_bytes=row_bytes)


@dataclass
class StepAccounts:
    """One micro-step's per-group accounts, filled layer by layer (:meth:`PolicyRun.step`)."""

    group_B: dict  # category -> seconds per group: the optimizer step's so far (its micro-steps' layers)
    fb_B2: np.ndarray  # the layers' forward and backward (pipeline stages, sim/stages.py)
    ephemeral_BLN: np.ndarray  # replicas each rank holds per layer
    persistent_BN: np.ndarray  # FlexMoE's replicas each rank updates, all layers
    gaps_BL: np.ndarray  # the link gaps of each layer's backward, and of its forward
    fgaps_BL: np.ndarray
    idle_B: np.ndarray  # the previous layer's forward time its gather link is free
    layer_degrees: list

    @classmethod
    def empty(cls, group_B: dict, B: int, L: int, N: int) -> "StepAccounts":
        return cls(group_B, np.zeros((B, 2)), np.zeros((B, L, N)), np.zeros((B, N)), np.zeros((B, L)),
                   np.zeros((B, L)), np.zeros(B), [])


class PolicyRun:
    """One policy at one group size, fed the world's ``tokens_LED`` step by step."""

    def __init__(self, name: str, setup: Setup, *, group_size: int | None = None, budget: int | None = None,
                 memory_cap: float | None = None, overlap_degree: int | None = None, fixed_t: bool | None = None,
                 max_groups: int | None = None, dispatcher=None, materializer=algorithm1, placement: str = "paper",
                 dispatch: str | None = None, dispatch_slack: float = 0.0, predictor: str = "window",
                 schedule: ScheduleOptions | None = None, decisions: list | None = None,
                 degrees: list | None = None, charges: list | None = None):
        """``overlap_degree``: t where it is not from the window (None: derived for the group, whose
        gathers stay on the intra-node links inside one node); ``fixed_t`` (default: whether
        ``overlap_degree`` is given) always, else under the idle-link schedule per layer and group
        from the window the last step left it (:class:`~ds_fssdp.planner.baselines.Clock`).
        ``budget`` None: the setup's m, or the ``memory_cap``'s. ``max_groups``: simulate only the
        first this many groups (their layers, planning, memory; the sync still spans every group): for
        traces whose groups are alike, a cheaper estimate that can only miss a slower group.
        ``dispatcher`` / ``materializer``: Algorithms 3 (compact, :func:`~ds_fssdp.planner.dispatch.dispatch_plan`)
        and 1 by default; others to compare. ``placement``: FSSDP's pre-gating placement
        (``planner.place``). ``dispatch``: a mode for the policy's own dispatcher, built as the
        runtime builds it (with the cost model; ``dispatcher`` then unused). ``predictor``: "window"
        (the runtime's) or "oracle" (:mod:`.foresight`). ``schedule``: FSSDP's
        :class:`~ds_fssdp.sim.pipeline.ScheduleOptions` (default all on; ``fsmoe`` takes its degree
        option, the other baselines run serially). Per step, lists that get each layer's:
        ``decisions`` the first group's ``(owner_E, placed_ED, held_ED)`` (what the runtime records as
        ``decision_owner/placed/held``), ``degrees`` the (forward, backward) degree per simulated
        group, ``charges`` the first group's :class:`LayerCharge`."""
        D = setup.topology.num_ranks
        N = D if group_size is None else group_size
        _check_run(name, setup, N, max_groups)
        self.name, self.setup, self.N, self.groups = name, setup, N, D // N
        self.B = self.groups if max_groups is None else min(self.groups, max_groups)  # groups simulated
        self.topo = Topology(num_ranks=N, ranks_per_node=min(setup.topology.ranks_per_node, N))
        self.rm, self.fssdp, self.planned = name == "fssdp-rm", name.startswith("fssdp"), name not in EP_HOLDERS
        self.deepspeed_moe = name in ("ep", "uniform")  # DeepSpeed's MoE: its engine syncs the experts (sim/sync.py)
        if memory_cap is not None:
            if budget is not None:
                raise ValueError("give a budget or a memory_cap, not both")
            budget = budget_for_cap(setup, N, memory_cap, rematerialize=self.rm)
        self.budget = budget if budget is not None else (setup.budget_rm if self.rm else setup.budget)
        self.memory_cap = memory_cap
        self.fixed_t = overlap_degree is not None if fixed_t is None else fixed_t
        self.overlap_degree = overlap_degree if overlap_degree is not None else derive_overlap_degree(
            setup.hw, self.topo, setup.shape, attention_s=setup.attention_fwd_s)
        self.options = policy_options(name, schedule)
        dispatcher = (dispatcher or functools.partial(dispatch_plan, mode="paper")) if dispatch is None else None
        self._build_planner(dispatcher, materializer, predictor,
                            placement=placement, dispatch=dispatch or "paper", dispatch_slack=dispatch_slack)
        self.decisions, self.degree_log, self.charges = decisions, degrees, charges
        self._init_accounts()

    def _build_planner(self, dispatcher, materializer, predictor: str, **settings) -> None:
        """The layer schedule, the cost model, the policy's planner inputs (as the runtime's), and per
        simulated group a predictor of its own ``tokens_ED`` with a :class:`LayerPlanner` per layer;
        re-shards plan from the world's loads."""
        st, options = self.setup, self.options
        L, E = st.num_layers, st.num_experts
        self.sched = LayerSchedule(st.hw, st.shape, ranks_per_node=self.topo.ranks_per_node, top_k=st.top_k,
                                   options=options, two_hops=lambda: self.inputs.two_hops, side_ratio=st.side_ratio)
        # placement by time: calibration and balanced-time price a plan as the schedule runs it
        self.cost = (ScheduledCostModel(st.hw, st.shape, self.topo, exchange=lambda: self.sched.exchange,
                                        costs=self.sched.costs)
                     if options.price_by_schedule else CostModel(st.hw, st.shape, self.topo))
        self.inputs = planner_inputs(sim_settings(self.name, st, budget=self.budget,
                                                  by_window=options.idle_link and not self.fixed_t,
                                                  t_by_time=options.t_by_time, overlap_degree=self.overlap_degree,
                                                  **settings),
                                     num_experts_L=[E] * L, topology=self.topo, cost=self.cost, dispatcher=dispatcher,
                                     materializer=materializer)
        self.policy = self.inputs.policy
        self.owner_LE = self.policy.initial_owner()
        self.reserved = self.policy.reserved_slots * L * st.shape.params  # FlexMoE's slots, with full state
        self.foresight = predictor == "oracle"
        self.world_predictor = make_predictor(predictor, [E] * L, window=st.load_window)
        self.planners_BL = [[LayerPlanner(self.policy, p, l) for l in range(L)]
                            for p in (make_predictor(predictor, [E] * L, window=st.load_window)
                                      for _ in range(self.B if self.planned else 0))]

    def _init_accounts(self) -> None:
        st = self.setup
        self.gather_class = INTER if self.topo.num_nodes > 1 else INTRA
        self.window_BL = np.full((self.B, st.num_layers), st.attention_fwd_s)  # replica gather windows (last step's)
        self.degree_counts, self.dedup_saved = ({}, {}), 0.0
        self.observed = 0
        self._sync_cache = {}  # split -> SyncTimes (the sync's links)
        self._ring_memo = {}  # the EDP ring's seconds per (bytes, collective)
        self._dense_s = dense_sync(st)
        self._split = False  # this step's experts' sync split around the step (decided after the last)
        self.split_steps = 0
        # one layer's all-gather of the counts in every group
        moved, nodes = float((self.N - 1) * st.num_experts * COUNT_BYTES), self.N // self.topo.ranks_per_node
        self.count_links = Links(np.full((self.B, self.N), moved), np.full((self.B, nodes), moved * (nodes > 1)))
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.links = {}  # category -> [bytes per GPU link, per node link] (the simulated groups', or the world's)
        self.step_s, self.straggler, self.inter_bytes, self.replicas = [], [], 0.0, 0.0
        self.count_s, self.plan_pre_s, self.plan_post_s = 0.0, 0.0, 0.0
        self.migrated, self.counted, self.peak_total, self.peak_memory = 0, 0, -1.0, {}
        self.micro_counted = 0  # timed micro-steps (trace rows); ``counted``: timed optimizer steps

    # -- per step ----------------------------------------------------------------------------------
    def step(self, s: int, tokens_LED: np.ndarray) -> None:
        """Trace row ``s``: one micro-step. Every ``Setup.gas``-th closes an optimizer step (the
        sync, the optimizer step), and the re-shards follow it, before the next micro-step, as the
        runtime's (its step count: ``s // gas``)."""
        tokens_LED = self._route(tokens_LED)
        st = self.setup
        timed = st.timed(s)
        if s % st.gas == 0:  # the optimizer step's running accounts, per group, in the order charged
            self._group_B = {c: np.zeros(self.B) for c in CATEGORIES}
            self._reshard_s = self._reshard(s // st.gas)
            self._group_B["rearr"] += self._reshard_s
        acc = StepAccounts.empty(self._group_B, self.B, st.num_layers, self.N)
        sync = self._sync(self._split)
        ar_class = binding_class(sync.links, st.hw) if self.options.grad_gaps else INTER
        for l in range(st.num_layers):
            self._layer(l, tokens_LED, acc, ar_class, timed)
        if self.degree_log is not None:
            self.degree_log.append(acc.layer_degrees)
        acc.group_B["comp"] += st.extra_compute_s  # every micro-step's dense layers
        owned_N = self._owned_N() * st.shape.params
        total, parts = peak_state(st, owned_N, acc.ephemeral_BLN, rm=self.rm, group_size=self.N, reserved=self.reserved)
        if total > self.peak_total:
            self.peak_total, self.peak_memory = total, parts
        if timed:
            self.micro_counted += 1
            self.count_s += st.num_layers * float(self.count_links.time_B(st.hw)[0])
        if st.boundary(s):
            self._close_step(acc, owned_N, sync, timed)
        self._observe(tokens_LED)

    def _layer(self, l: int, tokens_LED: np.ndarray, acc: StepAccounts, ar_class: int, timed: bool) -> None:
        """Layer ``l`` of every simulated group: planned (or EP's holders), priced by the schedule,
        its replicas' gather and reduce charged past their windows; the gaps and windows it leaves
        go to ``acc``."""
        st = self.setup
        E, N, B = st.num_experts, self.N, self.B
        attn_f = st.attention_fwd_s
        attn_b = 2.0 * attn_f
        group_B = acc.group_B
        tokens_BEN = tokens_LED[l].reshape(E, self.groups, N)[:, :B].transpose(1, 0, 2)
        window_B = np.array([overlap_window(attn_f, float(i), early=self.options.idle_link) for i in acc.idle_B])
        if self.planned:
            holder_BE, flows_4F, spag = self._plan_layer(l, tokens_BEN, acc, timed)
        else:
            owner_E = self.owner_LE[l]
            shard_ED = shard_placement(owner_E, N)
            _log_layer(self.decisions, l, (owner_E.clone(), shard_ED.clone(), shard_ED.clone()))
            holder_BE, flows_4F, spag = np.broadcast_to(owner_E.numpy(), (B, E)), None, None
        lt = self.sched.layer(traffic_BNN(tokens_BEN, holder_BE, flows_4F))
        group_B["comp"] += attn_f + attn_b + lt.moe_B + lt.side_B
        group_B["a2a"] += lt.forward_B + lt.backward_B - lt.moe_B - lt.side_B
        acc.fb_B2 += np.stack([attn_f + lt.forward_B, attn_b + lt.backward_B], 1)
        window_b_B = (self.sched.reduce_windows(lt, attn_f, across_nodes=self.gather_class == INTER)
                      if self.options.idle_link else np.full(B, attn_b))
        charge = LayerCharge(moe_s=float(lt.forward_B[0] + lt.backward_B[0]), window_s=float(window_B[0]),
                             backward_window_s=float(window_b_B[0]))
        hidden = (np.zeros(B), ) * 3  # on the sync's links: the reduce; the gather in this layer's span, the one before
        if spag is not None:
            hidden = self._charge_replicas(spag, window_B, window_b_B, ar_class, group_B, charge)
        self._leave_gaps(l, lt, acc, ar_class, hidden)
        _log_layer(self.charges, l, charge)
        if timed:
            self._count_layer(lt)

    def _leave_gaps(self, l: int, lt, acc: StepAccounts, ar_class: int, hidden: tuple) -> None:
        """The windows layer ``l``'s forward leaves the next layer's gather (idle link), and the
        gaps its backward and forward leave the sync's links (less the replicas' hidden parts)."""
        attn_f = self.setup.attention_fwd_s
        reduce_hidden_B, gather_here_B, gather_before_B = hidden
        if self.options.idle_link:
            acc.idle_B = np.maximum(0.0, lt.forward_B - lt.busy_forward_B2[:, self.gather_class])
            if l + 1 < self.setup.num_layers:
                self.window_BL[:, l + 1] = [overlap_window(attn_f, float(i)) for i in acc.idle_B]
        acc.gaps_BL[:, l] = 2.0 * attn_f + lt.backward_B - lt.busy_backward_B2[:, ar_class] - reduce_hidden_B
        acc.fgaps_BL[:, l] = attn_f + lt.forward_B - lt.busy_forward_B2[:, ar_class] - gather_here_B
        if l:
            acc.fgaps_BL[:, l - 1] -= gather_before_B
        acc.layer_degrees.append(lt.degrees)

    def _charge_replicas(self, spag: tuple, window_B: np.ndarray, window_b_B: np.ndarray, ar_class: int,
                         group_B: dict, charge: LayerCharge) -> tuple:
        """[spag]: the replicas' gather past its window, the reduce (twice under re-materialization)
        past the backward's, calibration's gather whole (the first group's into ``charge``). Returns
        what of the reduce, and of the gather in this layer's span and the one before, sits on the
        sync's links (0 elsewhere)."""
        hw, attn_f = self.setup.hw, self.setup.attention_fwd_s
        B = window_B.shape[0]
        gather, reduce, calib, times = spag
        # Nothing to gather costs 0, hence max(0, 0 - window) = 0: no "if any" needed.
        gather_B = np.maximum(0.0, gather.time_B(hw) - window_B)
        reduce_B = np.maximum(0.0, reduce.time_B(hw) * times - window_b_B)
        calib_B = calib.time_B(hw)
        for part_B in (gather_B, reduce_B, calib_B):
            group_B["spag"] += part_B
        charge.gather_s, charge.reduce_s, charge.calibration_s = (float(x[0]) for x in (gather_B, reduce_B, calib_B))
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

    def _close_step(self, acc: StepAccounts, owned_N: np.ndarray, sync, timed: bool) -> None:
        """The optimizer step after its last micro-step ``acc``: the slowest group (over the step's
        micro-steps: the groups meet at the sync), the exposed sync and the optimizer step, the
        phases (sim/stages.py) and, when timed, the totals."""
        st, group_B = self.setup, acc.group_B
        slowest = int(np.argmax(sum(group_B.values())))
        ar_s = self._exposed_sync(acc, owned_N, slowest, timed)
        updated_BN = optimizer_params(st, owned_N + acc.persistent_BN * st.shape.params, self.N)
        opt_s = float(updated_BN.max()) * OPT_TRAFFIC_BYTES / st.hw.hbm_bw
        group_B["ar"] += ar_s
        group_B["opt"] += opt_s
        # the slowest group's forward and backward and the iteration's own parts, per step (sim/stages.py)
        self.phases = dict(rearr=self._reshard_s, comp=st.extra_compute_s * st.gas, ar=ar_s, opt=opt_s,
                           forward=float(acc.fb_B2[slowest, 0]), backward=float(acc.fb_B2[slowest, 1]),
                           spag=float(group_B["spag"][slowest]))
        if timed:
            self.counted += 1
            self._add_links("ar", sync.links, 1.0)
            step = {c: group_B[c][slowest] for c in CATEGORIES}
            for c in CATEGORIES:
                self.totals[c] += step[c]
            self.step_s.append(sum(step.values()))

    def _exposed_sync(self, acc: StepAccounts, owned_N: np.ndarray, slowest: int, timed: bool) -> float:
        """Seconds of the step's sync it waits for, and the runtime's split decision for the next step.
        The experts' sync from the runtime's inputs (sim/sync.py): with the gaps, each layer's reduce
        issued after its backward on the boundary micro-step, sent in the gaps below; its all-gather
        (split, or ZeRO 1) before its first use in the next forward (its replica gather, a layer ahead,
        under FSSDP), in the forward's gaps. DeepSpeed's dense collectives after the backward."""
        st = self.setup
        split = self._split or st.zero_stage >= 1
        if self.deepspeed_moe:  # DeepSpeed's: the experts after the dense gradients, after the backward
            sync = self._sync(split)
            return exposed_sync(sync.step_gather_s + sync.reduce_s + sync.forward_gather_s, None, gaps=False,
                                split=split, lead=0)
        experts = expert_inputs(st, self.N, self.owner_LE.numpy(), acc.gaps_BL[slowest], acc.fgaps_BL[slowest],
                                memo=self._ring_memo)
        exposed = exposed_sync(self._dense_s, experts, gaps=self.options.grad_gaps, split=split,
                               lead=1 if self.fssdp else 0)
        # the experts' all-gather ran in the next forward (EP and Uniform gather at the step)
        self.split_steps += int(timed and experts is not None and split and self.options.grad_gaps)
        if self.fssdp and self.options.grad_gaps and st.zero_stage == 0 and experts is not None:
            # The runtime's decision for the next step (ZeRO 0: the experts' all-reduce whole, or split
            # with each layer updated where its summed gradients land), from this step's gaps.
            self._split = split_sync_pays(*experts, lead=1)
        return exposed

    def _plan_layer(self, l: int, tokens_BEN: np.ndarray, acc: StepAccounts, timed: bool):
        """Plan layer ``l`` group by group (the policy, timed): the holders, the flows and the
        sparse collectives' links (gather, reduce, calibration, reduce repeats) of all groups;
        FasterMoE's and FlexMoE's charges go to ``acc``."""
        st = self.setup
        B, N, E, G = self.B, self.N, st.num_experts, self.topo.ranks_per_node
        psi = float(st.shape.expert_bytes)
        owner_E = self.owner_LE[l]
        holder_BE = np.empty((B, E), dtype=np.int64)
        hidden_BEN, calibrated_BEN, gathered_BEN = (np.empty((B, E, N), dtype=bool) for _ in range(3))
        flows, held = [], 0.0
        for b in range(B):
            tokens_ED = torch.from_numpy(np.ascontiguousarray(tokens_BEN[b], dtype=np.int64))
            lp, plan = self._plan_group(b, l, tokens_ED, timed)
            holder_BE[b] = plan.holder_E
            x, h, d, k = plan.flows_4F
            flows.append(np.stack([np.full_like(x, b), h, d, k]))
            hidden_BEN[b], calibrated_BEN[b] = lp.hidden_ED.numpy(), lp.calibrated_ED.numpy()
            gathered_BEN[b] = lp.gathered_ED.numpy()  # what calibration evicted was gathered too
            acc.ephemeral_BLN[b, l] = lp.ephemeral_ED.sum(0).numpy()
            held += float(lp.persistent_ED.sum())
            self._charge_baselines(b, owner_E, lp, acc)
        shard_EN = shard_placement(owner_E, N).numpy()
        gather, reduce, calib = (sparse_collective_links(owner_E.numpy(), shard_EN | held_BEN, ranks_per_node=G,
                                                         chunk_bytes=psi, relay=self.inputs.relay)
                                 for held_BEN in (gathered_BEN, hidden_BEN | calibrated_BEN, calibrated_BEN))
        times = 2.0 if self.rm else 1.0
        if timed:
            self.replicas += float(acc.ephemeral_BLN[:, l].sum() + held) / st.num_layers / B
            self._add_links("spag", Links(gather.rank_BN + times * reduce.rank_BN + calib.rank_BN,
                                          gather.node_Bn + times * reduce.node_Bn + calib.node_Bn), 1.0)
        return holder_BE, np.concatenate(flows, 1), (gather, reduce, calib, times)

    def _plan_group(self, b: int, l: int, tokens_ED: torch.Tensor, timed: bool) -> tuple:
        """Group ``b``'s layer plan and dispatch plan, its planning timed (thread CPU time)."""
        planner, owner_E = self.planners_BL[b][l], self.owner_LE[l]
        if self.foresight:
            planner.predictor.foresee(l, tokens_ED)
        t0 = time.thread_time()
        # t from the window the last step's schedule left (or the fixed t)
        clock = self.inputs.clock_rule.clock(float(self.window_BL[b, l]), self.setup.attention_fwd_s)
        placement_ED, overlap_t = planner.pre_gating_t(owner_E, clock)
        t1 = time.thread_time()
        lp = planner.post_gating(owner_E, placement_ED, tokens_ED, clock, overlap_t=overlap_t)
        plan = planner.dispatch(lp, tokens_ED)
        t2 = time.thread_time()
        if timed:
            self.plan_pre_s += (t1 - t0) / self.B
            self.plan_post_s += (t2 - t1) / self.B
        if b == 0:
            _log_layer(self.decisions, l, (owner_E.clone(), placement_ED.clone(), lp.placement_ED.clone()))
        return lp, plan

    def _charge_baselines(self, b: int, owner_E: torch.Tensor, lp, acc: StepAccounts) -> None:
        """Group ``b``'s FasterMoE shadows (broadcast [rearr], reduce [ar]) and FlexMoE replicas
        (all-reduce [ar]; their optimizer step)."""
        group_B = acc.group_B  # the shard placement only where a baseline holds something (not FSSDP's groups)
        if bool(lp.shadow_ED.any()):
            bcast = self.cost.broadcast_time(owner_E, shard_placement(owner_E, self.N) | lp.shadow_ED)
            group_B["rearr"][b] += bcast
            group_B["ar"][b] += bcast
        if bool(lp.persistent_ED.any()):
            holders_ED = shard_placement(owner_E, self.N) | lp.persistent_ED
            groups_KD = holders_ED[holders_ED.sum(1) > 1]
            group_B["ar"][b] += self.cost.allreduce_time(groups_KD, torch.full((groups_KD.shape[0], ),
                                                                               float(self.setup.shape.expert_bytes)))
            acc.persistent_BN[b] += lp.persistent_ED.sum(0).numpy()

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
                    # float64 (the predictor's dtype; counts: exact): one copy, not two
                    planner.observe(torch.from_numpy(np.ascontiguousarray(tokens_LEBN[l, :, b], dtype=np.float64)))
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

    def _sync(self, split: bool):
        """The step's sync at the owners (:func:`~ds_fssdp.sim.sync.sync_times`): its links and
        the link class it binds on; ``split`` (ZeRO 0): the experts' all-reduce split around the step."""
        if split not in self._sync_cache:
            self._sync_cache[split] = sync_times(self.setup, self.N, self._owned_N(), split_experts=split)
        return self._sync_cache[split]

    def _owned_N(self) -> np.ndarray:
        return np.bincount(self.owner_LE.numpy().ravel(), minlength=self.N).astype(np.float64)

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


def run_cluster(runs: list, source, *, bound: bool = True, bounds: list | None = None) -> list:
    """Feed every step of ``source`` (an iterable of ``tokens_LED``: a [S, L, E, D] array, or a
    :class:`~ds_fssdp.sim.loadcv.LoadCVSource`) to every run in turn; their results, each with
    the workload's :class:`~ds_fssdp.sim.bound.LowerBound` (the least over the runs' group sizes,
    with the most replicas any run may hold) as ``lower_bound_s`` (none under gradient
    accumulation: the bound prices one micro-step per optimizer step). ``bounds``: the bounds to step
    and take the least of instead (the paper's report's)."""
    st = runs[0].setup if runs else None
    if bounds is None and bound and st is not None and st.gas == 1:
        budget = max([r.budget for r in runs if r.fssdp], default=0)
        # past the most a run holds without re-materializing, the reduce runs twice (fssdp-rm)
        plain = max([r.budget for r in runs if r.fssdp and not r.rm], default=0)
        shapes = dict.fromkeys((r.N, r.B) for r in runs)  # runs of one group shape share a bound
        bounds = [LowerBound(st, group_size=N, budget=budget, groups=B, plain=plain) for N, B in shapes]
    bounds, steps = bounds or [], 0
    for s, tokens_LED in enumerate(source):
        tokens_LED = np.asarray(tokens_LED)
        if tokens_LED.shape != (st.num_layers, st.num_experts, st.topology.num_ranks):
            L, E, D = tokens_LED.shape
            raise ValueError(f"trace is [steps, {L} layers, {E} experts, {D} ranks] but the setup has "
                             f"{st.num_layers} layers, {st.num_experts} experts, {st.topology.num_ranks} ranks")
        for stepped in (*runs, *bounds):
            stepped.step(s, tokens_LED)
        steps += 1
    if st is not None and steps < st.rows_needed:
        raise ValueError(f"the trace has {steps} steps; the simulation needs {st.rows_needed}: one whole optimizer "
                         f"step ({st.gas} rows) after the load window ({st.load_window})")
    results = [run.result() for run in runs]
    low = min((b.result() for b in bounds), default=None)
    for r in results:
        r.lower_bound_s = low
    return results


def simulate(setup: Setup, tokens_SLED: np.ndarray, policies, *, bound: bool = True, fixed_t: bool = False,
             **options) -> list:
    """The paper's report: one :class:`~ds_fssdp.sim.report.PolicyResult` per policy name, in order,
    each run on one group of every rank, t the setup's where not from the window (``fixed_t``: never
    from it). ``options``: :class:`PolicyRun`'s (dispatcher, materializer, placement, dispatch,
    dispatch_slack, predictor, schedule). ``bound``: every result's ``lower_bound_s`` (one
    micro-step per optimizer step: none under gradient accumulation) with the most replicas any
    policy may hold: FasterMoE's shadows are not bounded by a budget (any rank may hold every
    expert), FlexMoE's slots are kept across steps, and past FSSDP's m replicas are re-materialized
    (fssdp-rm) or broadcast (FasterMoE): their reduce is charged twice."""
    tokens_SLED = np.asarray(tokens_SLED)
    runs = [PolicyRun(name, setup, overlap_degree=setup.overlap_degree, fixed_t=fixed_t, **options)
            for name in policies]
    low = []
    if bound and setup.gas == 1:
        most = setup.num_experts if "fastermoe" in policies else max(setup.budget, setup.budget_rm)
        kept = setup.flexmoe_slots if "flexmoe" in policies else 0
        low = [LowerBound(setup, group_size=setup.topology.num_ranks, budget=most, persistent=kept, plain=setup.budget)]
    return [r.paper() for r in run_cluster(runs, tokens_SLED, bounds=low)]


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

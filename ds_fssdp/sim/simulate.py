"""Replay a routing trace through each policy and charge every iteration's critical path.

Legend: S steps, L layers, E experts, D ranks.

Per iteration, in the runtime's order: ``reshard`` (migration), then per layer ``pre_gating``
(placement from the sliding-window prediction), ``route``, ``post_gating``, the policy's
dispatcher, and the predictor observes the routed loads. What is charged (seconds; Figure 11's
categories in brackets):

per layer
* [comp] attention forward T_attn = tokens x (8 d^2 + 2 S d) / FLOP/s and backward 2 T_attn (same
  on every rank); the MoE compute of the slowest rank, rows x 2 x params x 3 / FLOP/s (forward and
  a backward of twice the forward).
* [a2a] four token exchanges (dispatch and combine, forward and backward), each decided by the
  busiest rank link or node link (:meth:`CostModel.a2a_time`); the straggler's waiting shows up
  here and in the compute. No system overlaps them with compute (as in the paper).
* [spag] the SparseAllGather of the hidden replicas (those calibration evicts included) minus the
  attention forward it hides under; the SparseReduceScatter of the replicas used (and fssdp-rm's
  second SparseAllGather) minus the attention backward; calibration's extra gather, all of it
  (critical path). Collectives are priced as the runtime moves them
  (:meth:`CostModel.gather_time`, ``planner/inputs.py``).
* [rearr] FasterMoE's broadcast of shadowed experts (critical path, NCCL's relayed broadcast:
  :meth:`CostModel.broadcast_time`).
* [ar] FasterMoE's reduce of the shadows' gradients (same time as the broadcast) and FlexMoE's
  all-reduce of replicated experts' gradients (ring, :meth:`CostModel.allreduce_time`), both
  exposed: the baselines issue them after the backward (paper Figure 1b).

per iteration
* [comp] what every policy computes alike beyond the MoE layers (``Setup.extra_compute_s``: shared
  experts, dense first layers; 0 for the paper's presets).
* [rearr] the reshard's copies (SmartMoE's permutation, FlexMoE's expansions, FSSDP's Algorithm 2):
  parameters + optimizer state, 14 bytes per parameter, all at once (:meth:`CostModel.transfer_time`).
* [ar] DeepSpeed's data-parallel all-reduce of the non-expert gradients (bf16, ring over all ranks;
  :func:`~ds_fssdp.sim.sync.dense_sync`): its engine runs it after the backward, so nothing hides it.
* [opt] the optimizer step of the busiest rank: memory bound, 28 bytes of HBM traffic per
  parameter it updates (dense + owned experts + FlexMoE's replicas) over the HBM bandwidth.

The layer schedule (:mod:`.pipeline`; FSSDP's by default, ``fsmoe``'s, or :data:`~.pipeline.SERIAL`,
which is the accounting above): [comp] keeps attention + the slowest rank's expert compute, [a2a]
becomes what the pipelined exchange adds to it (``pipeline_time`` forward + backward at the
chosen degrees, minus that compute), over the bytes left by one copy per destination; the
gather of layer l + 1 hides in its attention forward plus the time layer l's forward leaves the
gather's link class free, and t comes from that window (the last step's, through the
:class:`~ds_fssdp.planner.baselines.Clock`); the reduce in the attention backward plus the time
its backward leaves that link free. Each result carries the workload's lower bound (:mod:`.bound`).

Gradient accumulation (``Setup.gas``): trace rows are micro-steps, each planned and charged layer
by layer (per layer above, and the extra compute); the [ar] sync and the [opt] step once per
optimizer step, after its last micro-step; the re-shards after it, before the next (the runtime's
step count); an iteration is an optimizer step. No bound then (it prices one micro-step per step).

Not modelled: contention between overlapped collectives and the token exchanges or the dense
all-reduce, the gate, norms and element-wise work (same for every policy), planning time.

Memory per rank (Figure 12; bytes): parameters 2, gradients 2 and optimizer state 12 per
parameter for the dense part and the owned experts; FlexMoE's reserved slots with full state
whether used or not; ephemeral replicas (FSSDP's, FasterMoE's shadows) with parameters and
gradients: all layers' at once (alive from their gather to their reduce), or with
re-materialization the largest two consecutive layers'. Reported at the rank and iteration where
the total peaks. Activations are not counted.

Averages are over the steps after the predictor's first full window (s >= w): steady state, so
what a policy does while its history fills (FlexMoE's first expansions) is not charged. The
predictor observes the routed loads (Uniform's even ones for Uniform).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ds_fssdp.planner.baselines import POLICY_NAMES
from ds_fssdp.planner.inputs import planner_inputs
from ds_fssdp.planner.schedule import overlap_window
from ds_fssdp.planner.cost import CostModel
from ds_fssdp.planner.layer import LayerPlanner, migrations
from ds_fssdp.planner.shard import shard_placement
from ds_fssdp.sim.memory import peak_state
from ds_fssdp.sim.setup import MIGRATE_BYTES, OPT_TRAFFIC_BYTES, Setup, sim_settings
from ds_fssdp.planner.dispatch import dispatch as planner_dispatch
from ds_fssdp.planner.materialize import materialize as algorithm1  # the default materializer
from ds_fssdp.sim.bound import LowerBound
from ds_fssdp.sim.foresight import ForesightPredictor, make_predictor
from ds_fssdp.sim.pipeline import INTER, INTRA, LayerSchedule, ScheduleOptions, scheduled_cost_model, policy_options
from ds_fssdp.sim.sync import dense_sync

CATEGORIES = ("comp", "a2a", "spag", "rearr", "ar", "opt")
SIM_POLICY_NAMES = POLICY_NAMES + ("fsmoe", )  # the planner's policies and FSMoE's schedule over EP


@dataclass
class LayerCharge:
    """What one layer's MoE part was charged (seconds): ``moe_s`` its exchanges and the slowest
    rank's compute (forward + backward, [comp] + [a2a]), and in [spag] the hidden gather past
    ``window_s``, the reduce (twice under re-materialization) past ``backward_window_s`` and
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


@dataclass
class PolicyResult:
    policy: str
    iteration_s: float
    breakdown_s: dict  # CATEGORIES -> mean seconds per iteration
    memory_bytes: dict  # param, grad, opt at the peak rank and iteration
    straggler: float  # mean over layers and steps of max / mean rows per rank
    inter_node_gb: float  # token bytes crossing nodes per iteration (4 exchanges, all layers)
    replicas_per_layer: float  # mean pairs beyond the shard (ephemeral + persistent)
    migrated_experts: int  # expert states copied by reshards over the whole run
    budget: int
    step_s: list = field(default_factory=list)
    lower_bound_s: float | None = None  # the workload's (ds_fssdp.sim.bound), alike for every policy
    degrees: dict = field(default_factory=dict)  # "forward"/"backward" -> {degree: timed layers (x groups)}
    dedup_saved_gb: float = 0.0  # link bytes one copy per destination saved per iteration (< 0: relays moved more)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy, "iteration_ms": 1e3 * self.iteration_s,
            "breakdown_ms": {k: 1e3 * v for k, v in self.breakdown_s.items()},
            "memory_gb": {k: v / 1e9 for k, v in self.memory_bytes.items()}, "straggler": self.straggler,
            "inter_node_gb": self.inter_node_gb, "replicas_per_layer": self.replicas_per_layer,
            "migrated_experts": self.migrated_experts, "budget": self.budget,
            "lower_bound_ms": None if self.lower_bound_s is None else 1e3 * self.lower_bound_s,
            "vs_lower_bound": None if self.lower_bound_s is None else self.iteration_s / self.lower_bound_s,
            "degrees": self.degrees, "dedup_saved_gb": self.dedup_saved_gb,
        }


def simulate(setup: Setup, tokens_SLED: np.ndarray, policies, *, dispatcher=planner_dispatch,
             materializer=algorithm1, placement: str = "paper", dispatch: str | None = None,
             dispatch_slack: float = 0.0, schedule: ScheduleOptions | None = None, bound: bool = True,
             fixed_t: bool = False, predictor: str = "window") -> list:
    """One :class:`PolicyResult` per policy name, in order. ``placement``: FSSDP's pre-gating
    placement (``planner.place``; "paper" is Algorithm 1, or ``materializer``). ``dispatch``: a
    dispatch mode for the policy's own dispatcher, as the runtime builds it (with the cost model,
    so "balanced-time" works; ``dispatcher`` is then not used). ``schedule``: FSSDP's layer
    schedule (:mod:`ds_fssdp.sim.pipeline`; default all on; the published baselines run serially,
    ``fsmoe`` is EP with FSMoE's). ``bound``: set every result's ``lower_bound_s``
    (:class:`~ds_fssdp.sim.bound.LowerBound`, with the most replicas any policy may hold).
    ``fixed_t``: FSSDP's t is the setup's ``overlap_degree`` (given), not the replicas' window's.
    ``predictor``: "window" (the runtime's) or "oracle" (:mod:`.foresight`: each layer's placement
    is planned on the loads it then routes)."""
    tokens_SLED = np.asarray(tokens_SLED)
    S, L, E, D = tokens_SLED.shape
    if (L, E, D) != (setup.num_layers, setup.num_experts, setup.topology.num_ranks):
        raise ValueError(f"trace is [steps, {L} layers, {E} experts, {D} ranks] but the setup has "
                         f"{setup.num_layers} layers, {setup.num_experts} experts, {setup.topology.num_ranks} ranks")
    if S < setup.rows_needed:
        raise ValueError(f"the trace has {S} steps; the simulation needs {setup.rows_needed}: one whole optimizer "
                         f"step ({setup.gas} rows) after the load window ({setup.load_window})")
    results = [simulate_policy(name, setup, tokens_SLED, dispatcher=dispatcher, materializer=materializer,
                               placement=placement, dispatch=dispatch, dispatch_slack=dispatch_slack,
                               schedule=schedule, fixed_t=fixed_t, predictor=predictor) for name in policies]
    if bound and setup.gas == 1:  # the bound prices one micro-step per optimizer step
        # FasterMoE's shadows are not bounded by a budget: with it, any rank may hold every expert.
        # FlexMoE's slots are kept across steps (not gathered every step). Past FSSDP's m, replicas
        # are re-materialized (fssdp-rm) or broadcast (FasterMoE): their reduce is charged twice.
        most = E if "fastermoe" in policies else max(setup.budget, setup.budget_rm)
        kept = setup.flexmoe_slots if "flexmoe" in policies else 0
        low = LowerBound(setup, group_size=D, budget=most, persistent=kept, plain=setup.budget)
        for s in range(S):
            low.step(s, tokens_SLED[s])
        for r in results:
            r.lower_bound_s = low.result()
    return results


def simulate_policy(name: str, setup: Setup, tokens_SLED: np.ndarray, *, dispatcher=planner_dispatch,
                    materializer=algorithm1, placement: str = "paper", dispatch: str | None = None,
                    dispatch_slack: float = 0.0, decisions: list | None = None,
                    schedule: ScheduleOptions | None = None, degrees: list | None = None,
                    fixed_t: bool = False, predictor: str = "window", charges: list | None = None) -> PolicyResult:
    """``dispatcher`` / ``materializer``: Algorithms 3 and 1 by default (the planner's, in C when
    built); pass others (e.g. the balancing dispatcher) to compare. ``decisions``: a list that
    gets, per step, each layer's ``(owner_E, placed_ED, held_ED)`` (the decisions the runtime
    records in its trace as ``decision_owner``, ``decision_placed``, ``decision_held``).
    ``degrees``: a list that gets, per step, each layer's (forward, backward) degree.
    ``predictor``: as :func:`simulate`. ``charges``: a list that gets, per step, each layer's
    :class:`LayerCharge` (what its MoE part was charged, and the windows it was charged against)."""
    run = PaperRun(name, setup, tokens_SLED.shape[3], dispatcher=dispatcher, materializer=materializer,
                   placement=placement, dispatch=dispatch, dispatch_slack=dispatch_slack, schedule=schedule,
                   fixed_t=fixed_t, predictor=predictor)
    for s in range(tokens_SLED.shape[0]):
        run.step(s, tokens_SLED[s], decisions=decisions, degrees=degrees, charges=charges)
    return run.result()


class PaperRun:
    """One policy in the paper engine (one group of every rank), fed ``tokens_LED`` step by step
    (:func:`simulate_policy`)."""

    def __init__(self, name: str, setup: Setup, D: int, *, dispatcher, materializer, placement: str,
                 dispatch: str | None, dispatch_slack: float, schedule: ScheduleOptions | None, fixed_t: bool,
                 predictor: str):
        L, E = setup.num_layers, setup.num_experts
        if setup.zero_stage != 0:
            raise ValueError(f"zero_stage ({setup.zero_stage}): the paper engine models ZeRO 0 only (one group, "
                             "FlexMoE's replicated slots); ZeRO 1 is modelled at cluster scale (sim/cluster.py)")
        topo, hw, shape = setup.topology, setup.hw, setup.shape
        self.name, self.setup, self.D = name, setup, D
        self.options = options = policy_options(name, schedule)
        self.sched = LayerSchedule(hw, shape, ranks_per_node=topo.ranks_per_node, top_k=setup.top_k,
                                   options=options, two_hops=lambda: self.inputs.two_hops, side_ratio=setup.side_ratio)
        if options.price_by_schedule:  # placement by time: calibration and balanced-time price the schedule
            self.cost = scheduled_cost_model(hw, shape, topo, self.sched)
        else:
            self.cost = CostModel(hw, shape, topo)  # sparse collectives priced as the runtime moves them
        self.rm = name == "fssdp-rm"
        self.budget = setup.budget_rm if self.rm else setup.budget
        attn_f = setup.attention_fwd_s
        if name not in SIM_POLICY_NAMES:
            raise ValueError(f"policy ({name!r}) must be one of {SIM_POLICY_NAMES}")
        self.inputs = planner_inputs(sim_settings(name, setup, budget=self.budget,
                                                  by_window=options.idle_link and not fixed_t,
                                                  t_by_time=options.t_by_time, placement=placement,
                                                  dispatch=dispatch or "paper", dispatch_slack=dispatch_slack),
                                     num_experts_L=[E] * L, topology=topo, cost=self.cost,
                                     dispatcher=None if dispatch else dispatcher, materializer=materializer)
        self.policy, self.rule = self.inputs.policy, self.inputs.clock_rule
        self.gather_class = INTER if topo.num_nodes > 1 else INTRA
        self.window_L = [attn_f] * L  # replica gather windows the last step's schedule left
        self.loads = make_predictor(predictor, [E] * L, window=setup.load_window)
        self.foresight = isinstance(self.loads, ForesightPredictor)
        self.planners = [LayerPlanner(self.policy, self.loads, l) for l in range(L)]
        self.owner_LE = self.policy.initial_owner()
        self.dense_s = dense_sync(setup)  # DeepSpeed's all-reduce after the backward (sim/sync.py)
        self.reserved = self.policy.reserved_slots * L * shape.params
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.step_s, self.straggler, self.inter_bytes, self.replicas = [], [], 0.0, 0.0
        self.migrated = 0
        self.peak_total, self.peak_memory = -1.0, {}
        self.counted, self.micro_counted = 0, 0  # timed optimizer steps, timed micro-steps (trace rows)
        self.degree_counts, self.dedup_saved = ({}, {}), 0.0

    def step(self, s: int, tokens_LED: np.ndarray, *, decisions: list | None, degrees: list | None,
             charges: list | None) -> None:
        """Trace row ``s``: one micro-step; every ``Setup.gas``-th closes an optimizer step (the dense
        all-reduce, the optimizer step), and the re-shards follow it, before the next, as the runtime's."""
        setup, L, D = self.setup, self.setup.num_layers, self.D
        if s % setup.gas == 0:
            self.br = dict.fromkeys(CATEGORIES, 0.0)
            self._reshard(s // setup.gas, self.br)
        br = self.br
        ephemeral_LD = torch.zeros(L, D, dtype=torch.float64)
        persistent_D = torch.zeros(D, dtype=torch.float64)
        layer_degrees = []
        idle = 0.0
        for l in range(L):
            idle = self._layer(s, l, tokens_LED, br, idle, decisions=decisions, charges=charges,
                               ephemeral_LD=ephemeral_LD, persistent_D=persistent_D, layer_degrees=layer_degrees)
        br["comp"] += setup.extra_compute_s
        if degrees is not None:
            degrees.append(layer_degrees)
        self._memory(ephemeral_LD)
        if not setup.boundary(s):
            return
        br["ar"] += self.dense_s  # DeepSpeed's, after the boundary's backward: nothing hides it
        self._optimizer(br, persistent_D)
        if setup.timed(s):
            self.counted += 1
            for k in CATEGORIES:
                self.totals[k] += br[k]
            self.step_s.append(sum(br.values()))

    def _reshard(self, step: int, br: dict) -> None:
        D, P = self.D, self.setup.shape.params
        attn_f, L = self.setup.attention_fwd_s, self.setup.num_layers
        for reshard in migrations(self.inputs.migrators, step, self.loads.predict_all(), self.owner_LE,
                                  clock=self.rule.reshard_clock(self.window_L, [attn_f] * L)):
            copies = reshard.copies_M4
            if copies.shape[0]:
                traffic_DD = torch.zeros(D * D, dtype=torch.float64).index_add_(
                    0, copies[:, 2] * D + copies[:, 3],
                    torch.full((copies.shape[0], ), float(MIGRATE_BYTES * P), dtype=torch.float64)).view(D, D)
                br["rearr"] += self.cost.transfer_time(traffic_DD)
                self.migrated += copies.shape[0]
            self.owner_LE = reshard.owner_LE

    def _layer(self, s: int, l: int, tokens_LED: np.ndarray, br: dict, idle: float, *, decisions, charges,
               ephemeral_LD, persistent_D, layer_degrees: list) -> float:
        """Plan, price and charge layer ``l``; returns the time its forward leaves the gather's link free."""
        setup, options, sched = self.setup, self.options, self.sched
        L, attn_f = setup.num_layers, setup.attention_fwd_s
        owner_E, planner = self.owner_LE[l], self.planners[l]
        window = overlap_window(attn_f, idle, early=options.idle_link)
        # t from the window the last step's schedule left, unless given (then the setup's, as
        # without the idle link: the planner's configured overlap degree)
        clock = self.rule.clock(float(self.window_L[l]), attn_f)
        tokens_ED = self.policy.route(torch.from_numpy(tokens_LED[l].astype(np.int64)))
        if self.foresight:
            self.loads.foresee(l, tokens_ED)
        placement_ED, overlap_t = planner.pre_gating_t(owner_E, clock)
        lp = planner.post_gating(owner_E, placement_ED, tokens_ED, clock, overlap_t=overlap_t)
        plan_EDD = planner.dispatch_dense(lp, tokens_ED)
        planner.observe(tokens_ED)
        if decisions is not None:
            if l == 0:
                decisions.append([])
            decisions[-1].append((owner_E.clone(), placement_ED.clone(), lp.placement_ED.clone()))

        rows_D = plan_EDD.sum((0, 1))
        lt = sched.layer(plan_EDD.sum(0).double().numpy()[None])
        moe_s = float(lt.moe_B[0] + lt.side_B[0])
        br["comp"] += 3.0 * attn_f + moe_s  # the attention's forward and its backward (twice as long)
        br["a2a"] += float(lt.forward_B[0] + lt.backward_B[0]) - moe_s
        layer_degrees.append(lt.degrees[0])
        window_b = float(sched.reduce_windows(lt, attn_f, across_nodes=self.gather_class == INTER)[0]) \
            if options.idle_link else 2.0 * attn_f
        charge = LayerCharge(moe_s=float(lt.forward_B[0] + lt.backward_B[0]), window_s=window,
                             backward_window_s=window_b)
        self._charge_replicas(owner_E, lp, charge, br, persistent_D)
        if options.idle_link:
            idle = max(0.0, float(lt.forward_B[0] - lt.busy_forward_B2[0, self.gather_class]))
            if l + 1 < L:
                self.window_L[l + 1] = overlap_window(attn_f, idle)
        if charges is not None:
            if l == 0:
                charges.append([])
            charges[-1].append(charge)
        ephemeral_LD[l] = lp.ephemeral_ED.sum(0).double()
        if setup.timed(s):
            self.micro_counted += l == 0
            mean_rows = float(rows_D.double().mean())
            self.straggler.append(float(rows_D.max()) / mean_rows if mean_rows > 0 else 1.0)
            self.inter_bytes += 4.0 * lt.links.inter_total
            self.replicas += float(lp.ephemeral_ED.sum() + lp.persistent_ED.sum()) / L
            self.dedup_saved += 4.0 * lt.saved_bytes
            for counts, deg in zip(self.degree_counts, lt.degrees[0]):
                counts[deg] = counts.get(deg, 0) + 1
        return idle

    def _charge_replicas(self, owner_E, lp, charge: LayerCharge, br: dict, persistent_D) -> None:
        """[spag] the replicas' gather past its window, their reduce past the backward's and
        calibration's gather into ``charge`` and ``br``; FasterMoE's shadows ([rearr], [ar]) and
        FlexMoE's slots' all-reduce ([ar])."""
        cost, D = self.cost, self.D
        shard_ED = shard_placement(owner_E, D)
        if bool(lp.gathered_ED.any()):  # what calibration evicted was gathered too
            gather = cost.gather_time(owner_E, shard_ED | lp.gathered_ED)
            charge.gather_s = max(0.0, gather - charge.window_s)
            br["spag"] += charge.gather_s
        if bool((lp.hidden_ED | lp.calibrated_ED).any()):
            reduce = cost.gather_time(owner_E, shard_ED | lp.hidden_ED | lp.calibrated_ED)
            reduce *= 2.0 if lp.rematerialize else 1.0  # fssdp-rm gathers again before it
            charge.reduce_s = max(0.0, reduce - charge.backward_window_s)
            br["spag"] += charge.reduce_s
        if bool(lp.calibrated_ED.any()):
            charge.calibration_s = cost.gather_time(owner_E, shard_ED | lp.calibrated_ED)
            br["spag"] += charge.calibration_s
        if bool(lp.shadow_ED.any()):
            bcast = cost.broadcast_time(owner_E, shard_ED | lp.shadow_ED)
            br["rearr"] += bcast
            br["ar"] += bcast
        if bool(lp.persistent_ED.any()):
            holders_ED = shard_ED | lp.persistent_ED
            groups_KD = holders_ED[holders_ED.sum(1) > 1]
            br["ar"] += cost.allreduce_time(groups_KD, torch.full((groups_KD.shape[0], ),
                                                                  float(self.setup.shape.expert_bytes)))
            persistent_D += lp.persistent_ED.sum(0).double()

    def _optimizer(self, br: dict, persistent_D) -> None:
        """[opt] the busiest rank's optimizer step."""
        setup, P = self.setup, self.setup.shape.params
        owned_D = torch.bincount(self.owner_LE.flatten(), minlength=self.D).double() * P
        updated_D = setup.dense_params + owned_D + persistent_D * P
        br["opt"] += float(updated_D.max()) * OPT_TRAFFIC_BYTES / setup.hw.hbm_bw

    def _memory(self, ephemeral_LD) -> None:
        """The peak of model-state memory."""
        owned_D = torch.bincount(self.owner_LE.flatten(), minlength=self.D).double().numpy() * self.setup.shape.params
        total, parts = peak_state(self.setup, owned_D, ephemeral_LD.numpy(), rm=self.rm, group_size=self.D,
                                  reserved=self.reserved)
        if total > self.peak_total:
            self.peak_total, self.peak_memory = total, parts

    def result(self) -> PolicyResult:
        counted = self.counted
        return PolicyResult(policy=self.name, iteration_s=sum(self.totals.values()) / counted,
                            breakdown_s={k: v / counted for k, v in self.totals.items()},
                            memory_bytes=self.peak_memory, straggler=float(np.mean(self.straggler)),
                            inter_node_gb=self.inter_bytes / counted / 1e9,
                            replicas_per_layer=self.replicas / max(1, self.micro_counted),
                            migrated_experts=self.migrated, budget=self.budget, step_s=self.step_s,
                            dedup_saved_gb=self.dedup_saved / counted / 1e9,
                            degrees={"forward": dict(sorted(self.degree_counts[0].items())),
                                     "backward": dict(sorted(self.degree_counts[1].items()))})

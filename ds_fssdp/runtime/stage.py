"""The FSSDP stage: expert shards, their owner-only optimizer, and their part of each step.

Legend: E experts, D ranks, S owned rows, P elements per expert.

DeepSpeed keeps the dense parameters (data parallel, ZeRO 0-3). The stage keeps every expert's
parameters, fp32 master and optimizer moments on its owner only (one owner per FSSDP group; with
several groups replicated or partitioned over the expert-data-parallel group,
``runtime/expert_dp.py``). Per micro-step it folds the owned and the replicas' reduced gradients
into the owner's gradient; at the optimizer step it averages them over all ranks like DeepSpeed's
data-parallel gradients, folds their norm into DeepSpeed's global norm, applies the same
unscale/clip factor, and steps them with the optimizer DeepSpeed built from the same config. The
policy and its cost model are built at attach (``runtime/policy_setup.py``). Gradients,
parameters and updates in the gaps (``fssdp.grads_in_gaps``; ``runtime/edp_sync.py``,
``expert_dp.py``): docs/design.md section 2; ``last_step`` records what each step did, and
:meth:`wait_in_flight` (checkpoint save and load, re-shards) lands all of it.
"""
from __future__ import annotations

import atexit
import dataclasses
import time

import numpy as np
import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from ds_fssdp.comm.sparse import scatter_rows
from ds_fssdp.config import FSSDPConfig
from ds_fssdp.moe.experts_module import FSSDPExperts
from ds_fssdp.moe.sharded import ReplicaMemory, ShardedExperts, ShardOptions, StepContext, chain
from ds_fssdp.planner import LoadPredictor, initial_ownership
from ds_fssdp.planner.baselines import Clock
from ds_fssdp.planner.decision import decision_arrays
from ds_fssdp.planner.inputs import build_policies
from ds_fssdp.planner.layer import migrations
from ds_fssdp.planner.scheduled import ExchangeOptions
from ds_fssdp.runtime import costfit, pipeline, policy_setup
from ds_fssdp.runtime.edp_sync import EDPSyncPlan
from ds_fssdp.runtime.expert_dp import engine_comm_dtype, make_expert_state
from ds_fssdp.runtime.expert_optimizer import build_expert_optimizer
from ds_fssdp.runtime.grad_norm import install_expert_norm, loss_scale_of
from ds_fssdp.runtime.groups import FSSDPGroups
from ds_fssdp.runtime.health import NonFiniteGuard

# Hyperparameters an LR/momentum schedule changes on DeepSpeed's optimizer; mirrored every step.
_SCHEDULED = ("lr", "betas", "momentum")


class FSSDPStage:

    def __init__(self, layers: list, config: FSSDPConfig, groups: FSSDPGroups, *, src_rank: int = 0,
                 grad_scale: float | None = None, zero_stage: int = 0, layout=None, global_layers: tuple | None = None):
        """``groups``: this rank's FSSDP group (``tokens``: the token exchange, None: the world;
        ``params``: the same ranks for the sparse collectives), its EDP group (the ranks at its
        position in every FSSDP group; None: one group), the group's nodes and the chunked token
        exchange's groups (``runtime/groups.py``). ``grad_scale``: DeepSpeed's factor on summed
        gradients (None: 1 / data-parallel size). ``zero_stage``: DeepSpeed's ZeRO stage for the
        dense parameters (checked against the engine's at :meth:`attach`). Pipeline parallelism
        (``runtime/pipeline.py``): ``layout`` (its ``dp_group``: the stage's data-parallel ranks,
        ``pipe_group``: the pipeline, for norms) and ``global_layers``: (each layer's index among
        all stages' MoE layers, their number; checkpoints key experts by it); no layers: a stage
        without MoE layers, which joins the step's collectives."""
        self.layers = list(layers)
        self.config = config
        self.topology, self.group, self.param_group, self.edp_group = groups.topology, groups.tokens, groups.params, \
            groups.edp
        self.layout = layout
        self.dp_group, self.pipe_group = (None, None) if layout is None else (layout.dp_group, layout.pipe_group)
        self.global_layers, self.num_global_layers = global_layers or (list(range(len(self.layers))), len(self.layers))
        self.in_flight = 1  # micro-batches awaiting their backward at once (a pipeline stage's: attach)
        self.zero_stage = zero_stage
        self._init_sizes(grad_scale)
        self._init_decisions()
        self._init_step_state()
        self.predictor = LoadPredictor([l.num_experts for l in self.layers], window=config.load_window)
        self.memory = ReplicaMemory()
        for i, layer in enumerate(self.layers):
            layer.attach_sharded(self._shard(i, layer, src_rank=src_rank, exchange=groups.exchange))
        chain(self.shards)

    def _init_sizes(self, grad_scale) -> None:
        """The data-parallel, FSSDP and EDP sizes, this rank's FSSDP group, DeepSpeed's gradient scale."""
        self.world = dist.get_world_size(group=self.dp_group)  # data-parallel ranks: gradients are averaged over them
        self.group_size = dist.get_world_size(group=self.group)  # ranks of this FSSDP group (owners)
        self.edp_size = dist.get_world_size(group=self.edp_group) if self.edp_group is not None else 1
        self.group_index = dist.get_rank(group=self.dp_group) // self.group_size
        # Summed expert gradients times this at the step: DeepSpeed's data-parallel average (its
        # divisor is W / s under Ulysses SP, runtime/sequence_parallel.py).
        self.grad_scale = 1.0 / self.world if grad_scale is None else grad_scale
        if self.group_size * self.edp_size != self.world:
            raise ValueError(f"FSSDP group ({self.group_size} ranks) x EDP group ({self.edp_size}) != world "
                             f"({self.world})")

    def _init_decisions(self) -> None:
        """What the layers' decisions are made from, built in :meth:`attach`."""
        config = self.config
        self.budget = None if config.materialization_budget == "auto" else config.materialization_budget  # m; attach
        # What each layer's forward asks its stage for (``_context``), built in attach.
        self.planners = []  # LayerPlanner per layer
        self.inputs = None  # planner.inputs.PlannerInputs: the policy, who re-shards, the clock rule
        self.cost = None  # CostModel (measured at attach or from fssdp.hardware), when a decision needs one
        self.pipeline_degree = config.pipeline_degrees()  # "auto" or (forward, backward)
        self.schedule_costs = None  # planner.schedule.ScheduleCosts for "auto" degrees, built in attach
        self.window_s = [None] * len(self.layers)  # the overlap windows every rank agreed on (seconds)
        self.reshard_load_LE = None  # the world's loads the last step's re-shards planned from (world_loads)
        self.attention_s = [None] * len(self.layers)  # and their attention parts (the replica reduces' windows)
        # Gradients in the gaps: each layer's EDP reduce slice and the split flag for the next step
        # (runtime/edp_sync.py), built in attach.
        self.edp_sync = None
        self._gaps = False  # this micro-step's backward starts the EDP reduces (before_backward)
        self._gaps_started = []  # layers whose EDP reduce started during this step's backward
        self._edp_reduce_s = 0.0  # the step's wait for the EDP reduces still in flight
        # The schedule's fitted costs (runtime/costfit.py): measured at attach, refitted every
        # cost_refresh_interval steps; equal on every rank.
        self.cost_fit = None
        self._steps_seen = 0
        self.timers = None

    def _init_step_state(self) -> None:
        self.optimizer = None
        self.expert_state = None  # ReplicatedExperts | PartitionedExperts (runtime/expert_dp.py), set in attach
        self.norm = None
        self.last_step = {}
        self.steps = 0
        self.profile = {}
        self.trace = None
        self.health = NonFiniteGuard(self.config.nonfinite)  # non-finite losses/gradients (runtime/health.py)
        self.trace_at_forward = self.layout is not None  # the pipeline engine records each forward's entry itself
        self.trace_file = pipeline.trace_file(self.config.trace_path, self.layout, rank=dist.get_rank(),
                                              global_layers=self.global_layers)

    def _shard(self, i: int, layer, *, src_rank: int, exchange) -> ShardedExperts:
        """Layer ``i``'s experts sharded over this rank's FSSDP group: its owned rows from a loader,
        fresh, or scattered from ``src_rank``."""
        if not isinstance(layer, FSSDPExperts):
            raise TypeError(f"FSSDPStage takes FSSDPExperts modules (FSSDPMoE is one), got {type(layer).__name__}")
        config, group = self.config, self.group
        layer.router_bias_update_rate = float(config.router_bias_update_rate)
        owner_E, owned_E = initial_ownership(layer.num_experts, group_size=self.group_size,
                                             group_rank=dist.get_rank(group=group))
        # Rows a loader already read for this rank, or fresh rows of a lazy layer's own experts:
        # nothing moves (every rank of every group has its own).
        rows_SP = layer.initial_rows(owner_E, owned_E, group_rank=dist.get_rank(group=group))
        if rows_SP is None:
            full_EP = layer.expert_rows()
            # Every owner starts from rank src_rank's initial values (of the first FSSDP group), as
            # DeepSpeed broadcasts the dense ones from rank 0 (a group of one rank owns them all).
            rows_SP = full_EP if self.group_size == 1 else scatter_rows(full_EP, owner_E, src=src_rank, group=group)
            if self.edp_group is not None:
                dist.broadcast(rows_SP, src=dist.get_global_rank(self.edp_group, 0), group=self.edp_group)
        # ZeRO-3's module hooks gather and release a module's weights around its own call: its blocks
        # compute their shared experts themselves (moe/side.py). Timed: only the refits read the spans.
        options = ShardOptions(uniform=config.policy == "uniform", rematerialize=config.rematerialize,
                               hierarchical=config.topology_aware,
                               one_copy_per_destination=config.one_copy_per_destination, side=self.zero_stage < 3,
                               timed=self._measures_costs() and bool(config.cost_refresh_interval))
        return ShardedExperts(spec=layer.spec, layer_index=i, owner_E=owner_E, rows_SP=rows_SP, topology=self.topology,
                              group=group, param_group=self.param_group, predictor=self.predictor, options=options,
                              memory=self.memory, trainable=layer.trainable, context=lambda l=i: self._context(l),
                              exchange=exchange)

    @property
    def shards(self) -> list:
        return [layer.sharded for layer in self.layers]

    def masters(self) -> list:
        """What the expert optimizer steps: each layer's fp32 master, or this rank's slice of it
        (frozen layers' too: they are in no optimizer and their gradients stay zero)."""
        return self.expert_state.params() if self.expert_state is not None else [s.master for s in self.shards]

    def state_bytes(self) -> dict:
        """Bytes of expert state on this rank: ``expert_params`` (compute rows), ``expert_master``
        (fp32 masters or their slices; in fp32 without partitioning they are the compute rows),
        ``expert_optimizer`` (moments), ``expert_total`` (distinct storage)."""
        return self.expert_state.state_bytes()

    def attach(self, engine) -> None:
        """Adopt the engine's precision and device, its optimizer type and its clipping."""
        dtype = (torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled()
                 else torch.float32)
        zero_stage = int(engine.zero_optimization_stage())
        if zero_stage != self.zero_stage:  # the layers were built for the config's (side work, moe/side.py)
            raise RuntimeError(f"fssdp: DeepSpeed runs ZeRO stage {zero_stage}, the stage was built for "
                               f"{self.zero_stage}")
        for shard in self.shards:
            shard.replicas.use_precision(dtype, engine.device)
        comm_dtype = engine_comm_dtype(engine, dtype)  # DeepSpeed's for its gradients (expert_dp.py)
        self.expert_state = make_expert_state(self.shards, zero_stage=zero_stage,
                                              edp_group=self.edp_group, edp_size=self.edp_size,
                                              edp_rank=self.group_index, comm_dtype=comm_dtype)
        self.optimizer = build_expert_optimizer(engine.basic_optimizer,
                                                [p for p, s in zip(self.masters(), self.shards) if s.trainable])
        self.expert_state.optimizer = self.optimizer
        self.norm = install_expert_norm(engine, dense_group=self.pipe_group)
        if self.layout is not None:  # 1F1B keeps S - s micro-batches' forwards awaiting their backward on stage s
            self.in_flight = min(engine.gradient_accumulation_steps(), self.layout.num_stages - self.layout.stage_id)
        if self.layers:  # a pipeline stage without MoE layers decides nothing
            self._configure_auto_and_policies(dtype, engine.device)
        self.edp_sync = EDPSyncPlan(self.shards, edp_group=self.edp_group, edp_size=self.edp_size,
                                    grads_in_gaps=self.config.grads_in_gaps, cost=self.cost,
                                    partitioned=self.expert_state.partitioned, optimizer=self.optimizer,
                                    ranks_per_node=self.topology.ranks_per_node,
                                    grad_bytes=comm_dtype.itemsize)
        if self._measures_costs():
            # The schedule's costs measured here, agreed and fitted (runtime/costfit.py); with
            # fssdp.hardware they come from it instead (policy_setup.py), and nothing is measured.
            self.cost_fit = costfit.measure(group=self.group, topology=self.topology, spec=self.layers[0].spec,
                                            dtype=dtype, device=engine.device,
                                            experts=max(1, self.layers[0].num_experts // self.group_size),
                                            agree_group=self.dp_group)
            self.schedule_costs = self.cost_fit.costs
            self.profile["schedule_costs"] = dataclasses.asdict(self.schedule_costs)
            logger.info(f"fssdp: schedule costs fitted {self.schedule_costs} (relative error "
                        f"{self.cost_fit.error:.3f})")
        if engine.wall_clock_breakdown():
            self.timers = engine.timers
        if self.trace_file and self.layers:
            from ds_fssdp.sim.traces import TraceWriter
            self.trace = TraceWriter(self.trace_file, meta={
                "top_k": self.layers[0].k, "ranks_per_node": self.topology.ranks_per_node,
                "policy": self.config.policy, "source": "ds_fssdp runtime (fssdp.trace_path)",
                # What ds_fssdp.report needs to replay the placements from the recorded loads.
                "materialization_budget": self.budget, "overlap_degree": self.config.overlap_degree,
                "load_window": self.config.load_window, "placement": self.config.placement,
                "dispatch": self.config.dispatch, "dispatch_slack": float(self.config.dispatch_slack),
                "reshard_interval": self.config.reshard_interval, "calibration": self.config.calibration,
                "calibration_latency_budget": self.config.calibration_latency_budget,
                "smartmoe_interval": self.config.smartmoe_interval, "rematerialize": self.config.rematerialize,
                "hardware": self.profile.get("hardware"), "expert_shape": self.profile.get("expert_shape"),
                # how the layers exchange tokens: the by-time decisions' layer price (planner/scheduled.py)
                "one_copy_per_destination": self.config.one_copy_per_destination,
                "pipeline_degree": (self.pipeline_degree if self.pipeline_degree == "auto"
                                    else list(self.pipeline_degree)),
                "topology_aware": self.config.topology_aware, "side_ratio": self.side_ratio,
                # the re-shards' loads are summed over the FSSDP groups; the trace holds rank 0's group's
                "fssdp_groups": self.edp_size,
                # under pipeline parallelism each stage's first rank records its stage's layers
                "pipeline_stages": 1 if self.pipe_group is None else dist.get_world_size(group=self.pipe_group),
                **({} if self.layout is None else {"pipeline_stage": self.layout.stage_id, "num_global_layers":
                                                   self.num_global_layers, "global_layers": list(self.global_layers)})})
            atexit.register(self.trace.close)
        # The first layer's gather starts with the model's forward, before the first attention.
        if self.layers:
            engine.module.register_forward_pre_hook(lambda module, args: self.shards[0].prefetch())
        logger.info(f"fssdp: {len(self.layers)} MoE layers, policy={self.config.policy}, "
                    f"{self.world // self.group_size} FSSDP groups of {self.topology.num_ranks} ranks in "
                    f"{self.topology.num_nodes} nodes, expert optimizer {type(self.optimizer).__name__} "
                    f"({'partitioned' if self.expert_state.partitioned else 'replicated'} over {self.edp_size} "
                    f"EDP ranks), expert dtype {dtype}, gradient sync in {comm_dtype}")

    # -- per micro-step -------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """A new micro-batch's training forward starts while earlier ones may still await their
        backward (the pipeline engine): each layer records it separately (``moe/records.py``)."""
        for shard in self.shards:
            shard.records.begin_forward()

    def before_backward(self, boundary: bool) -> None:
        """Gradients in the gaps (``fssdp.grads_in_gaps``), on the accumulation boundary only: each
        layer's EDP reduce starts when its owned gradient is final during this backward."""
        self._gaps = bool(self.config.grads_in_gaps and boundary and self.expert_state is not None)
        self._gaps_started = []

    def _start_gap_reduce(self, i: int) -> None:
        nbytes = self.edp_sync.layer_slice_bytes(i)
        self.expert_state.start_reduce(i, self.grad_scale, max(1, nbytes // self.edp_sync.grad_bytes))
        self._gaps_started.append(i)

    def wait_in_flight(self) -> None:
        """Land every expert gradient reduce started in the gaps and every EDP all-gather left in
        flight by the step (before a checkpoint or anything that reads or moves expert state
        between the backward and the step, or between the step and the next forward)."""
        if self.expert_state is not None:
            self.expert_state.wait_in_flight()

    def after_backward(self, loss=None) -> None:
        for shard in self.shards:
            shard.accumulate_grads()
        self._gaps = False
        if self.edp_sync is not None:
            self.edp_sync.record_loads()
        if not self.trace_at_forward:
            self.record_trace(loss)

    def restore(self, steps: int, *, planning: dict | None = None) -> None:
        """A checkpoint's optimizer steps and ``planning`` state (None: kept): the load predictor's, the
        agreed windows and their attention parts (none in a checkpoint from before they were saved)."""
        self.steps = steps
        if planning is not None:
            self.predictor.load_state_dict(planning["predictor"])
            self.window_s = list(planning["window_s"])
            self.attention_s = list(planning.get("attention_s", [None] * len(self.window_s)))

    def record_trace(self, loss=None, *, clear: bool = True) -> None:
        """The trace's entry of the last training forward of every layer (``clear``: only once)."""
        if getattr(self, "trace", None) is not None and all(s.last_tokens_ED is not None for s in self.shards):
            self.trace.append(torch.stack([s.last_tokens_ED for s in self.shards]),
                              loss=float(loss) if loss is not None else float("nan"),
                              arrays=dict(decision_arrays([s.last_decision for s in self.shards]),
                                          **self._decision_inputs()))
            if clear:
                for s in self.shards:
                    s.clear_record()

    def _decision_inputs(self) -> dict:
        """What this iteration's decisions were made from besides the counts and the recorded costs
        (docs/traces.md), for the report's replay to derive them again: the optimizer steps applied
        before it (the re-shards follow them, not the micro-steps) and the windows every rank agreed
        on (nan: none yet), from which each layer's clock is derived (``planner.inputs.ClockRule``), and with
        several FSSDP groups the world's loads the re-shards planned from (the trace holds one group's counts)."""
        def seconds(values):
            return np.asarray([float("nan") if v is None else float(v) for v in values], dtype=np.float64)
        out = {"optimizer_step": np.int64(self.steps), "agreed_window_s": seconds(self.window_s),
               "agreed_attention_s": seconds(self.attention_s)}
        if self.edp_size > 1 and self.migrators:  # summed over the groups: the trace holds one group's counts
            load_LE = self.reshard_load_LE
            out["reshard_world_load"] = np.full((len(self.layers), self.layers[0].num_experts), np.nan) \
                if load_LE is None else load_LE.numpy()
        return out

    # -- per optimizer step ---------------------------------------------------------------------
    @torch.no_grad()
    def before_step(self, engine) -> None:
        """Average the expert gradients over ranks and arm DeepSpeed's norm with theirs."""
        t0 = time.perf_counter()
        sq = self.expert_state.reduce(self.grad_scale).to(engine.device)
        self._edp_reduce_s = time.perf_counter() - t0
        sq += self.health.loss_flag(sq)  # +inf where this rank's loss was not finite: all ranks learn it
        # Over the data-parallel ranks: each expert counted once (expert_dp.py), every rank's loss flag
        # heard; under pipeline parallelism then over the pipeline (each stage holds its own layers).
        dist.all_reduce(sq, group=self.group if self.edp_size == 1 else self.dp_group)
        if self.pipe_group is not None:
            dist.all_reduce(sq, group=self.pipe_group)
        self.norm.arm(sq, loss_scale_of(engine.optimizer))
        group0 = engine.basic_optimizer.param_groups[0]
        self._scheduled = {k: group0[k] for k in _SCHEDULED if k in group0}

    @torch.no_grad()
    def after_step(self, engine) -> None:
        applied = not getattr(engine.optimizer, "overflow", False) and not self.health.skip
        factor = self.norm.disarm()
        split = self.expert_state.split  # decided after the last step (EDPSyncPlan.decide_split)
        # The step's collectives over the EDP group run before the all-gathers publish leaves in
        # flight: a group's collectives run in order (one NCCL stream), so one issued after them,
        # and the host's read of its result, would wait for every layer's all-gather.
        self._agree_on_windows(engine.device)
        if applied and self.edp_size > 1:  # the bias updates count loads over the world: each group saw its own
            for layer in self.layers:
                for load_E in layer.pending_loads():
                    load_E.copy_(self._edp_reduce(load_E))
        next_split = self.edp_sync.decide_split(engine.device, attention_s=self.attention_s,
                                                schedule_costs=self.schedule_costs)
        self.edp_sync.plan_slices(engine.device, split=next_split, schedule_costs=self.schedule_costs)
        self.reshard_load_LE, moves = None, []
        if applied and self.migrators:
            self.reshard_load_LE = self.world_loads()
            moves = self.plan_reshard(self.reshard_load_LE, step=self.steps + 1)
        deferred = []  # layers whose EDP all-gather lands in the next forward (expert_dp.py)
        if applied:
            if self.optimizer is not None:  # None: every expert is frozen
                for group in self.optimizer.param_groups:  # split: what each layer's landing steps with
                    group.update({k: v for k, v in self._scheduled.items() if k in group})
                if not split:  # split: each layer steps where its gradient lands (expert_dp.py)
                    if factor != 1.0:
                        for master in self.masters():
                            master.grad.mul_(factor)
                    self.optimizer.step()
            deferred = self.expert_state.publish(deferred=self.config.grads_in_gaps, factor=factor)
            for layer in self.layers:
                layer.update_routing_bias()
            self.steps += 1
        self.expert_state.clear_grads()
        for i, shard in enumerate(self.shards):
            shard.replicas.stepped(deferred=i in deferred)
        self.expert_state.split = next_split
        resharded = self.reshard(moves)
        self._steps_seen += 1
        interval = self.config.cost_refresh_interval
        if interval and self.cost_fit is not None and self._steps_seen % interval == 0:
            # from every layer's recorded exchange and GEMM timings, agreed over the data-parallel ranks
            self.cost_fit.refit([s.timings for s in self.shards], group=self.dp_group, device=engine.device)
            self.schedule_costs = self.cost_fit.costs
        if engine.wall_clock_breakdown() and engine.global_steps % engine.steps_per_print() == 0:
            engine.timers.log(["fssdp_gather_wait", "fssdp_reduce_wait"])
        self.last_step = {"applied": applied, "expert_grad_factor": factor, "global_grad_norm": self.norm.global_norm,
                          "replica_bytes_peak": self.memory.peak, "reshard_bytes_sent": resharded,
                          "replica_layers_peak": self.memory.layers_peak,
                          "edp_reduce_in_gaps": list(self._gaps_started),
                          "edp_reduce_wait_s": self._edp_reduce_s,
                          "edp_reduce_slice_bytes": list(self.edp_sync.slice_bytes),
                          "edp_gather_in_gaps": deferred,
                          "edp_split": split,
                          "cost_fit_error": self.cost_fit.error if self.cost_fit is not None else None}
        self.memory.reset_peak()

    def close(self) -> None:
        """Write what is pending (the trace). Also runs at interpreter exit."""
        if self.trace is not None:
            self.trace.close()

    def _configure_auto_and_policies(self, dtype, device) -> None:
        """Measure what the "auto" knobs, calibration and FasterMoE need; build the policy
        (runtime/policy_setup.py)."""
        cfg, layer = self.config, self.layers[0]
        if cfg.materialization_budget == "auto":
            self.budget = policy_setup.auto_budget(cfg, expert_bytes=self.shards[0].expert_bytes,
                                                   num_layers=len(self.layers), in_flight=self.in_flight)
            self.profile["materialization_budget"] = self.budget
        shape = layer.spec.cost_shape(torch.tensor([], dtype=dtype).element_size())
        if policy_setup.needs_cost_model(cfg, edp_size=self.edp_size):
            self.cost, measured = policy_setup.cost_model(
                cfg, spec=layer.spec, shape=shape, topology=self.topology, group=self.param_group,
                expert_bytes=self.shards[0].expert_bytes, exchange=lambda: self.exchange_options(shape), dtype=dtype,
                device=device, costs=lambda: self.schedule_costs,  # the costs the degrees are chosen from
                agree_group=self.agree_group)
            self.profile.update(measured)
        if self._schedule_decided() and cfg.hardware is not None:
            self.schedule_costs = policy_setup.configured_schedule_costs(cfg.hardware, shape)
            self.profile["schedule_costs"] = dataclasses.asdict(self.schedule_costs)
        self.inputs, self.planners = build_policies(
            cfg, num_experts=[l.num_experts for l in self.layers], topology=self.topology, budget=self.budget,
            cost=self.cost, predictor=self.predictor)

    def exchange_options(self, shape) -> ExchangeOptions:
        """How this run's layers exchange their tokens, for the by-time decisions' layer price
        (planner/scheduled.py; the report's replay rebuilds it from the trace's record); two hops as
        the planner inputs say (``planner.inputs.PlannerInputs.two_hops``)."""
        cfg = self.config
        return ExchangeOptions.of(shape, top_k=self.layers[0].k, one_copy=cfg.one_copy_per_destination,
                                  pipeline_degree=self.pipeline_degree, two_hops=self.inputs.two_hops,
                                  side_ratio=self.side_ratio)

    @property
    def side_ratio(self) -> float:
        """The work beside the exchange the by-time decisions price a layer with, expert rows per
        token: the first MoE layer's (a family binds the same shared experts in every layer; each
        layer's own degrees price its own, ``moe/sharded.py``)."""
        return float(self.layers[0].side_ratio) if self.layers else 0.0

    def _measures_costs(self) -> bool:
        """Whether attach measures and fits the schedule's costs (runtime/costfit.py): a decision
        comes from them and ``fssdp.hardware`` does not give them."""
        return self._schedule_decided() and self.config.hardware is None and bool(self.layers)

    def _schedule_decided(self) -> bool:
        """Whether a layer decision comes from the schedule's costs ("auto" pipeline degrees or one
        copy per destination)."""
        return self.pipeline_degree == "auto" or self.config.one_copy_per_destination == "auto"

    def clock(self, l: int) -> Clock:
        """Layer ``l``'s t and calibration latency budget this iteration, from the window every rank
        agreed on (the one clock rule: ``planner.inputs.ClockRule``)."""
        return self.inputs.clock_rule.clock(self.window_s[l], self.attention_s[l],
                                            num_experts=self.layers[l].num_experts)

    @property
    def migrators(self) -> list:
        """Who re-shards after a step (``planner.layer.migrating_policies``)."""
        return [] if self.inputs is None else self.inputs.migrators

    def _context(self, l: int) -> StepContext:
        return StepContext(planner=self.planners[l], clock=self.clock(l), timers=self.timers,
                           pipeline_degree=self.pipeline_degree, schedule_costs=self.schedule_costs,
                           two_hops=self.inputs.two_hops,
                           gaps=(lambda: self._start_gap_reduce(l)) if self._gaps else None)

    @property
    def agree_group(self):
        """The ranks whose planning inputs (measured costs, windows) must be equal: the FSSDP group,
        or with several groups every data-parallel rank, since the groups re-shard alike."""
        return self.param_group if self.edp_size == 1 else self.dp_group

    def _agree_on_windows(self, device) -> None:
        """Decisions that use the measured attention windows ("auto" t, calibration's budget, the
        split of ZeRO 0's EDP sync) must be the same on every rank: once per step, all ranks adopt
        the largest measured window (a pipeline stage without MoE layers has none to agree on)."""
        if not self.shards or (self.config.overlap_degree != "auto"
                and not (self.config.calibration and self.config.calibration_latency_budget is None)
                and not (self.edp_sync is not None and self.edp_sync.may_split)):
            return
        w = torch.tensor([s.measured_window_s or 0.0 for s in self.shards] +
                         [s.measured_attention_s or 0.0 for s in self.shards], dtype=torch.float64, device=device)
        # over every group: the re-shards' t comes from the window, and every group must plan the same owners
        dist.all_reduce(w, op=dist.ReduceOp.MAX, group=self.agree_group)
        first = self.window_s[0] is None
        agreed = w.tolist()
        self.window_s, self.attention_s = agreed[:len(self.shards)], agreed[len(self.shards):]
        if first and self.config.overlap_degree == "auto":
            t_L = [self.clock(l).overlap_degree for l in range(len(self.shards))]
            logger.info(f"fssdp: overlap_degree auto -> t = {t_L} per layer "
                        f"(windows {[round(v * 1e3, 3) for v in w.tolist()]} ms)")

    def plan_reshard(self, load_LE, *, step: int) -> list:
        """The re-shards after optimizer step ``step`` (:func:`ds_fssdp.planner.layer.migrations`:
        Algorithm 2 every ``reshard_interval`` steps, SmartMoE's permutation every
        ``smartmoe_interval``) on the predicted loads of all layers summed over the groups
        (``load_LE``: :meth:`world_loads`), checked equal in every FSSDP group. Planned before the
        step's deferred all-gathers are issued: the check runs on the EDP group, behind them otherwise."""
        owner_LE = torch.stack([s.owner_E for s in self.shards])
        clock = self.inputs.clock_rule.reshard_clock(self.window_s, self.attention_s)
        moves = migrations(self.migrators, step, load_LE, owner_LE, clock=clock)
        self._check_groups_agree(moves[-1].owner_LE if moves else owner_LE, step=step)
        return moves

    def reshard(self, moves: list) -> int:
        """Every expert the planned re-shards ``moves`` (:meth:`plan_reshard`) move migrates its
        state. Returns the bytes this rank sent for all of them."""
        sent = 0
        for r in moves:
            self.wait_in_flight()  # only when something moves: the step's all-gathers stay in flight otherwise
            sent += sum(self.expert_state.migrate(i, r.owner_LE[i], self.param_group) for i in range(len(self.shards)))
            logger.info(f"fssdp: re-sharded at step {self.steps}: {r.copies_M4.shape[0]} experts moved ({sent} bytes "
                        "sent by this rank)")
        return sent

    def _check_groups_agree(self, owner_LE: torch.Tensor, *, step: int) -> None:
        """With several FSSDP groups the EDP sync sums each position's experts over the groups, so
        the groups must plan the same owners: different ones would sum different experts'
        gradients. One all-reduce (the minimum of the owners and of their negation) over the EDP
        group before anything moves; a difference is an error that names the layers."""
        if self.edp_size == 1:
            return
        both = self._edp_reduce(torch.stack([owner_LE, -owner_LE]), op=dist.ReduceOp.MIN)
        layers = (both[0] != -both[1]).any(1).nonzero().flatten().tolist()
        if layers:
            raise RuntimeError(f"fssdp: the FSSDP groups planned different owners at optimizer step {step} "
                               f"(layers {layers}): a re-shard's inputs differ between groups")

    def world_loads(self):
        """Predicted loads of all layers (float64 [L, E]) summed over the FSSDP groups, so that
        every group plans the same owners (None without history: the same in every group)."""
        load_LE = self.predictor.predict_all()
        return load_LE if load_LE is None or self.edp_size == 1 else self._edp_reduce(load_LE)

    def _edp_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """``t`` reduced over the EDP group on the layers' device (NCCL reduces device tensors
        only), returned on the host."""
        out = t.to(self.shards[0].rows.device, copy=True)
        dist.all_reduce(out, op=op, group=self.edp_group)
        return out.cpu()


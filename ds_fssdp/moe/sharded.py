"""One MoE layer's experts on one rank under FSSDP: the per-layer flow, top to bottom.

Legend: E experts, D ranks, S owned rows, R replica rows, P elements per expert, T tokens, H hidden.

Three parts, each with one job (Megatron-Core's router / dispatcher / experts):

* the per-layer planner (``planner/layer.py``, pure): predict, place, calibrate or shadow, plan
  the dispatch, observe; the same object the simulators and the report's replay drive;
* the replica manager (``moe/replicas.py``): owned rows, gathers, reduces, re-materialization,
  memory accounting;
* the token dispatcher (``moe/dispatcher.py``): route plus ``compute.dispatch_compute_combine``
  (with ``one_copy_per_destination``: ``dispatch_compute_combine_dedup``; at pipeline degrees
  other than (1, 1) their chunked forms in ``moe/pipeline.py``).

What changes per step (the policy's planner, the clock: t and calibration's latency budget,
DeepSpeed's timers, the gaps' callback) comes from ``context()``, a callable the stage passes in;
how the layer runs from its ``ShardOptions``; this forward's LoRA factors from the experts
module's call. Nothing is set on a shard from outside (``tests/test_module_shape.py``).

Per iteration, ``prefetch()`` (before the attention that precedes the layer: plan the placement,
start the SparseAllGather of the added replicas), ``forward()`` (counts, post-gating, dispatch plan,
the next layer's gather, exchange, compute, exchange back) and the backward's SparseReduceScatter,
folded by ``accumulate_grads()``: docs/design.md section 4.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

import torch
from deepspeed import comm as dist

from ds_fssdp.moe.compute import mlp_fn
from ds_fssdp.moe.dedup import DedupRoute
from ds_fssdp.moe.dispatcher import TokenDispatcher
from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.moe.gate import GateOutput, uniform_assignment
from ds_fssdp.moe.pipeline import ExchangeGroups, PipelineExperts
from ds_fssdp.moe.records import MicrobatchRecords
from ds_fssdp.moe.remat import RematExpertMLP
from ds_fssdp.moe.replicas import ReplicaManager, ReplicaMemory
from ds_fssdp.moe.timing import LayerTimings
from ds_fssdp.planner import LoadPredictor, PolicyConfig, make_policy
from ds_fssdp.planner.baselines import Clock, LayerPlan
from ds_fssdp.planner.layer import LayerPlanner
from ds_fssdp.planner.decision import Decision
from ds_fssdp.planner.onecopy import INDEX_BYTES
from ds_fssdp.planner.schedule import ScheduleCosts, overlap_window
from ds_fssdp.planner.scheduled import exchange_decision
from ds_fssdp.topology import Topology

__all__ = ["ShardedExperts", "ShardOptions", "StepContext", "ReplicaMemory", "chain"]


@dataclass(frozen=True)
class ShardOptions:
    """How a layer runs (not what it decides: that is the policy's)."""
    uniform: bool = False  # policy "uniform": spread each rank's assignments evenly over the experts
    rematerialize: bool = False
    hierarchical: bool = True  # topology-aware (two-phase) sparse collectives across nodes
    one_copy_per_destination: bool | str = True  # a token crosses to a rank once (moe/dedup.py); with
    # hierarchical and several nodes: to a node once, forwarded inside it; "auto": per layer and step
    # where the schedule's costs say it pays (planner.onecopy.choose_exchange)
    side: bool = False  # may compute its block's shared experts beside the exchange (moe/side.py): not under
    # ZeRO-3, whose module hooks gather and release them around the block's own call
    timed: bool = True  # record the exchange and GEMM spans (moe/timing.py): the stage's cost refits read them


@dataclass(frozen=True)
class StepContext:
    """What a layer needs from its stage for one iteration."""
    planner: LayerPlanner
    clock: Clock
    timers: object | None = None  # DeepSpeed's SynchronizedWallClockTimer for the exposed waits
    pipeline_degree: object = (1, 1)  # (forward, backward) chunks of the token exchange, or "auto"
    schedule_costs: ScheduleCosts | None = None  # what "auto" decides from (agreed by every rank)
    two_hops: bool = True  # the exchange priced as two hops across nodes (planner.inputs.PlannerInputs.two_hops)
    # Gradients in the gaps: called when this micro-step's owned gradient is final (the stage starts
    # the layer's EDP reduce, runtime/edp_sync.py); None: not this micro-step
    gaps: Callable[[], None] | None = None


def default_context(num_experts: int, topology: Topology, predictor: LoadPredictor, layer: int) -> Callable:
    """Expert parallelism with the balanced dispatcher and the config's clock: a layer used on
    its own (tests, tools), outside a stage."""
    policy = make_policy("ep", PolicyConfig(num_experts=num_experts, num_layers=layer + 1, topology=topology,
                                            dispatch="balanced"))
    ctx = StepContext(planner=LayerPlanner(policy, predictor, layer), clock=Clock())
    return lambda: ctx


@dataclass
class _Iteration:
    """What one forward decided, for an activation-checkpoint recompute to replay."""
    idx_TK: torch.Tensor  # the routing it was given (a recompute must give the same)
    route: object
    layout: object
    replica_RP: torch.Tensor | None  # None under RM: gathered again for the backward
    remat: bool
    hooked: bool  # the replicas' gradient hook is registered (the first pass built a graph)
    degrees: tuple = (1, 1)  # the pipeline degrees it ran at
    side: bool = False  # it computed the block's work beside the exchange (moe/side.py)


@dataclass
class _Gathered:
    """The replicas one forward computes with: the prefetched gather's and what post-gating added."""
    lp: LayerPlan | None  # post-gating's decision
    layout: object  # the final replicas' layout
    replica_RP: torch.Tensor
    layouts: list  # the layouts the gathers moved (the hidden one, then post-gating's)
    sent: int  # bytes this rank sent for them
    exposed_s: float  # the wait for the prefetched gather
    critical_s: float = 0.0  # post-gating's gather, on the critical path


class ShardedExperts:

    def __init__(self, *, spec: ExpertSpec, layer_index: int, owner_E: torch.Tensor, rows_SP: torch.Tensor,
                 topology: Topology, group, param_group=None, predictor: LoadPredictor,
                 options: ShardOptions = ShardOptions(), memory: ReplicaMemory | None = None, trainable: bool = True,
                 context: Callable[[], StepContext] | None = None, exchange: ExchangeGroups | None = None):
        """``context``: the stage's per-iteration inputs (None: :func:`default_context`);
        ``exchange``: the chunked token exchange's groups (None: ``group`` for every pair)."""
        self.spec = spec
        self.layer_index = layer_index
        self.topology = topology
        self.group = group
        self.rank = dist.get_rank(group=group)
        self.options = options
        E = owner_E.numel()
        self.context = context if context is not None else default_context(E, topology, predictor, layer_index)
        # What each forward in flight leaves for its backward, oldest first (moe/records.py)
        self.records = MicrobatchRecords()
        self.replicas = ReplicaManager(spec=spec, owner_E=owner_E, rows_SP=rows_SP, topology=topology,
                                       param_group=group if param_group is None else param_group, rank=self.rank,
                                       memory=memory if memory is not None else ReplicaMemory(), trainable=trainable,
                                       hierarchical=options.hierarchical, rematerialize=options.rematerialize,
                                       records=self.records, gaps=lambda: self.context().gaps)
        # Exchange, GEMM and whole-layer spans (forward and backward): the cost model's refits.
        self.timings = LayerTimings(rank=self.rank, ranks_per_node=topology.ranks_per_node, enabled=options.timed)
        if exchange is None:
            exchange = ExchangeGroups(intra=group, inter=None, ranks_per_node=topology.num_ranks)
        self.dispatcher = TokenDispatcher(group=group, rank=self.rank, num_experts=E, exchange=exchange,
                                          world=topology.num_ranks, dedup=options.one_copy_per_destination is True,
                                          ranks_per_node=topology.ranks_per_node if options.hierarchical else None,
                                          timings=self.timings)
        self.next = self.prev = None  # the following and preceding MoE layers (prefetch chain, :func:`chain`)
        self._gather = None  # (placement_ED, t, layout, SparseAllGather) started for the next forward
        self.stats = {}
        self.measured_window_s = None  # this rank's moving average of the overlap window (schedule.overlap_window)
        self.measured_attention_s = None  # and of its attention part alone (the replica reduce's window)
        self._prefetch_t = None
        self._started_next = None  # (the next layer's gather, when this compute ended): this forward started it
        self.last_tokens_ED = None  # the last training forward's all-gathered counts (trace recording)
        self.last_decision = None  # and what it decided

    # -- the owned state (the replica manager's) --------------------------------------------------
    owner_E = property(lambda self: self.replicas.owner_E)
    owned_E = property(lambda self: self.replicas.owned_E)
    rows = property(lambda self: self.replicas.rows)
    master = property(lambda self: self.replicas.master)
    trainable = property(lambda self: self.replicas.trainable)
    memory = property(lambda self: self.replicas.memory)
    expert_bytes = property(lambda self: self.replicas.expert_bytes)

    # -- placement -----------------------------------------------------------------------------
    def plan_placement(self, ctx: StepContext) -> tuple:
        """``(placement_ED, t)``: this iteration's pre-gating placement and its overlap degree."""
        return ctx.planner.pre_gating_t(self.owner_E, ctx.clock)

    def prefetch(self) -> None:
        """Plan this iteration's placement and start its SparseAllGather (asynchronous)."""
        if self._gather is not None:
            return
        self._prefetch_t = time.perf_counter()
        placement_ED, t = self.plan_placement(self.context())
        layout = self.replicas.layout(placement_ED)
        self._gather = (placement_ED, t, layout, self.replicas.start_gather(layout))

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x_TH: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, counts_E: torch.Tensor, *,
                observe: bool = True, side=None, lora=None) -> tuple:
        """Returns ``(out_TH, tokens_ED)``; ``tokens_ED`` is None for a recompute. ``observe``: feed
        this iteration's loads to the predictor (a training forward). ``side``: the block's work
        beside the exchange (``moe.side.SideWork``; priced into the degrees, computed and delivered
        at a chunked exchange, left to the block at degree 1), or None. ``lora``: this forward's
        LoRA factors, a callable local_E -> factors by weight name (``ops.lora``), or None.

        A forward run inside a backward pass (activation checkpointing recomputing its segment)
        is not a new iteration: it replays the last recorded forward of this layer (same route,
        same replicas, re-gathered under RM) and plans, observes and prefetches nothing."""
        # a recompute: the micro-batch whose backward runs has a recorded forward left to replay
        record = self.records.backward_record() if torch._C._current_graph_task_id() != -1 else None
        if record is not None and record.iterations:
            return self._replay(x_TH, idx_TK, weights_TK, side, lora), None
        ctx = self.context()
        self.replicas.land()  # the step's EDP all-gather, where no prefetch's gather landed it
        gate_idx_TK = idx_TK
        if self.options.uniform:
            g = uniform_assignment(GateOutput(idx_TK, weights_TK, None, counts_E), self.owner_E.numel(),
                                   rank=self.rank)
            idx_TK, counts_E = g.idx_TK, g.counts_E
        self.prefetch()
        window, early_s, early_end = self._measure_window()
        (placed_ED, overlap_t, layout, gather), self._gather = self._gather, None
        grouped = self.dispatcher.group_by_expert(idx_TK)  # before the waits: needs no plan
        tokens_ED = self.dispatcher.all_gather_counts(counts_E)
        got = self._replicas_for(ctx, gather, placed_ED, layout, tokens_ED, overlap_t)
        plan = ctx.planner.dispatch(got.lp, tokens_ED)
        token_bytes = x_TH.shape[1] * x_TH.element_size()
        traffic_DD = functools.cache(lambda: plan.traffic_DD().numpy())  # what "auto" decides from, once
        side_ratio = 0.0 if side is None else side.ratio
        # what is "auto" is the schedule's choice on the agreed costs and this plan's traffic (one on every rank)
        degrees, one_copy = exchange_decision(
            ctx.schedule_costs, traffic_DD, pipeline_degree=ctx.pipeline_degree,
            one_copy=self.options.one_copy_per_destination, ranks_per_node=self.topology.ranks_per_node,
            token_bytes=token_bytes, top_k=idx_TK.shape[1], weight_bytes=weights_TK.element_size(),
            two_hops=ctx.two_hops, side_ratio=side_ratio)
        r = self.dispatcher.route(idx_TK, plan, local_E=got.layout.local_E, grouped=grouped, dedup=one_copy,
                                  degrees=degrees)
        out_TH, early_next = self._compute(x_TH, weights_TK, r, got, gate_idx_TK=gate_idx_TK, observe=observe,
                                           degrees=degrees, side=side, lora=lora)
        prediction_error = float("nan")  # of the loads the plan assumed
        if observe:
            prediction_error = ctx.planner.observe(tokens_ED)
            self.last_tokens_ED = tokens_ED
            self.last_decision = Decision.of(self.owner_E, placed_ED, got.lp, plan, ctx.clock, degrees, one_copy,
                                             overlap_t=overlap_t, schedule_costs=ctx.schedule_costs,
                                             row_bytes=(token_bytes, weights_TK.element_size()),
                                             side_ratio=side_ratio)
        self.stats = self._stats(got, plan, tokens_ED, token_bytes=token_bytes, prediction_error=prediction_error,
                                 window=window, overlap_t=overlap_t, ctx=ctx)
        self.stats.update({"pipeline_degree_fwd": degrees[0], "pipeline_degree_bwd": degrees[1],
                           "one_copy": int(one_copy),
                           "side_overlapped": int(side is not None and tuple(degrees) != (1, 1)),
                           "gather_early_s": early_s, "gather_started_early": early_end is not None,
                           "next_gather_started_early": early_next})
        self.stats.update(_dedup_stats(r, plan, topology=self.topology, token_bytes=token_bytes,
                                       weight_bytes=weights_TK.element_size(), k=idx_TK.shape[1]))
        return out_TH, tokens_ED

    def _measure_window(self) -> tuple:
        """``(window, early_s, early_end)``: the window that hid this layer's gather (one function,
        planner/schedule.overlap_window): the previous layer's exchange + expert compute when it
        started the gather (``early_s``, ended at ``early_end``; None: it did not), then the
        attention; folded into this rank's moving averages."""
        started = self.prev._started_next if self.prev is not None else None
        now = time.perf_counter()
        early_end = started[1] if started is not None and started[0] is self._gather else None
        early_s = 0.0 if early_end is None else early_end - self._prefetch_t
        attention = now - (self._prefetch_t if early_end is None else early_end)
        window = overlap_window(attention, early_s)
        m, a = self.measured_window_s, self.measured_attention_s
        self.measured_window_s = window if m is None else 0.9 * m + 0.1 * window
        self.measured_attention_s = attention if a is None else 0.9 * a + 0.1 * attention
        return window, early_s, early_end

    def _replicas_for(self, ctx: StepContext, gather, placed_ED, layout, tokens_ED, overlap_t: int) -> _Gathered:
        """Wait for the prefetched replicas (the exposed part timed), then post-gating: it returns
        what it decided, and what it adds is gathered now, on the critical path."""
        t0 = time.perf_counter()
        _timer(ctx.timers, "fssdp_gather_wait", True)
        replica_RP = gather.finish()
        _timer(ctx.timers, "fssdp_gather_wait", False)
        exposed_s = time.perf_counter() - t0
        got = _Gathered(lp=None, layout=layout, replica_RP=replica_RP, layouts=[layout], sent=gather.sent,
                        exposed_s=exposed_s)
        got.lp = lp = ctx.planner.post_gating(self.owner_E, placed_ED, tokens_ED, ctx.clock, overlap_t=overlap_t)
        extra_ED = (lp.calibrated_ED | lp.shadow_ED) & ~placed_ED
        if bool(extra_ED.any()):
            t1 = time.perf_counter()
            _, got.layout, got.replica_RP, delta, extra_sent = self.replicas.gather_now(
                placed_ED, layout, replica_RP, extra_ED, lp.evicted_ED)
            got.critical_s = time.perf_counter() - t1
            got.sent += extra_sent
            got.layouts.append(delta)
        elif lp.evicted_ED is not None:
            raise RuntimeError(f"fssdp layer {self.layer_index}: post-gating evicted replicas without adding any")
        return got

    def _compute(self, x_TH, weights_TK, r, got: _Gathered, *, gate_idx_TK, observe: bool, degrees: tuple,
                 side, lora) -> tuple:
        """``(out_TH, early_next)``: the exchange and expert compute over this forward's replicas,
        recorded for its backward (or recompute); the next layer's gather started first where
        nothing started it yet (``early_next``)."""
        layout, replica_RP = got.layout, got.replica_RP
        grad = torch.is_grad_enabled()
        # A forward that a backward may follow (or recompute, under checkpointing) is recorded.
        record = grad or observe
        remat = record and self.options.rematerialize and self.next is not None  # the last layer keeps its own
        hooked = False
        if remat:
            self.replicas.drop_for_backward(layout)
        elif grad and self.trainable:
            self.replicas.hook_replicas(replica_RP, layout)
            hooked = True
        # -- replicas on the idle link: the next layer's gather starts now, before this layer's token
        # exchange and expert compute (on GPUs it would use the link class the exchange leaves idle).
        early_next = self.next is not None and self.next._gather is None
        if early_next:
            self.next.prefetch()
        out_TH = self._run(x_TH, weights_TK, r, replica_RP, remat=remat, local_E=layout.local_E, degrees=degrees,
                           other=lambda: self._other_bytes(early_next), side=side, lora=lora)
        if early_next:
            self._started_next = (self.next._gather, time.perf_counter())
        if not record or remat:
            self.replicas.uncount(replica_RP)  # freed with this frame (RM: not saved for backward)
        if record:
            mine = self.records.forward_record()
            mine.iterations.append(_Iteration(gate_idx_TK, r, layout, None if remat else replica_RP, remat, hooked,
                                              degrees, side is not None))
            self.replicas.adopt(mine)  # the replicas its backward keeps alive are counted for it
        return out_TH, early_next

    def _replay(self, x_TH, idx_TK, weights_TK, side=None, lora=None) -> torch.Tensor:
        """The recompute of the micro-batch in backward's last recorded forward (its oldest in
        flight; moe/records.py): same route and replicas, new autograd graph (and its work beside
        the exchange again, where it ran there)."""
        it = self.records.backward_record().iterations.pop()
        if not torch.equal(idx_TK.to(it.idx_TK.device), it.idx_TK):
            raise RuntimeError(f"fssdp layer {self.layer_index}: the recomputed forward routed tokens differently "
                               "from the original one (a non-deterministic router under activation checkpointing; "
                               "keep the checkpoint's preserve_rng_state on)")
        replica_RP = it.replica_RP
        if it.remat:
            replica_RP = self.replicas.rematerialized()  # the backward of the same Function reuses it
        elif torch.is_grad_enabled() and self.trainable and not it.hooked:
            self.replicas.hook_replicas(replica_RP, it.layout)  # the first pass ran without a graph (reentrant)
        return self._run(x_TH, weights_TK, it.route, replica_RP, remat=it.remat, local_E=it.layout.local_E,
                         degrees=it.degrees, side=side if it.side else None, lora=lora)

    def _other_bytes(self, early_next: bool) -> tuple:
        """Bytes of the replicas' collectives in flight during this layer's timed forward and
        backward (``planner.schedule.LayerLoad.other_*_bytes``; units of ``LayerTimings.link_bytes``):
        (fwd intra, fwd inter, bwd intra, bwd inter), when the forward span starts. Forward: the
        next layer's gather when this forward started it (``early_next``) and its first,
        asynchronous phase has not landed yet. Backward: none (this layer's replica reduce starts
        after its backward span: the replicas' ``torch.cat`` with the owned rows is made before the
        span, ``benchmarks/replica_spans.py``); RM's re-gathers are not counted either."""
        if early_next and self.next._gather is not None:
            _, _, layout, gather = self.next._gather
            phases = layout.phases if gather.in_flight else None
            if phases:
                return (*self.timings.link_bytes(phases[0].send_splits, phases[0].recv_splits,
                                                 self.next.expert_bytes), 0.0, 0.0)
        return (0.0, 0.0, 0.0, 0.0)

    def _run(self, x_TH, weights_TK, r, replica_RP, *, remat: bool, local_E, degrees: tuple,
             other=None, side=None, lora=None) -> torch.Tensor:
        """Degree (1, 1): today's ``compute.dispatch_compute_combine`` (the block computes its
        side work itself); otherwise the chunked pipeline (``moe/pipeline.py``) over the same
        weights, with ``side`` computed beside the exchange. ``other``: the timing's other bytes
        (:meth:`_other_bytes`). ``lora``: the forward's LoRA factors (:meth:`forward`; refused
        at initialize with rematerialize, whose backward recomputes the MLP outside autograd)."""
        plain = r.route if isinstance(r, DedupRoute) else r  # the timing's units: rows per assignment
        lora = lora(local_E) if lora is not None else None  # of the experts computed here
        if tuple(degrees) == (1, 1):
            expert_fn = self._expert_fn(replica_RP, remat=remat, lora=lora)
            return self.timings.layer(lambda x: self.dispatcher.run(x, weights_TK, r, expert_fn=expert_fn), x_TH,
                                      plain, other=other)
        experts = PipelineExperts(spec=self.spec, rows=self.rows, replica=replica_RP, lora=lora,
                                  source=self.replicas if remat else None)
        side_rows = 0.0 if side is None else side.ratio * float(x_TH.shape[0])
        return self.timings.layer(lambda x: self.dispatcher.run_pipelined(x, weights_TK, r, experts=experts,
                                                                          degrees=tuple(degrees), side=side),
                                  x_TH, plain, other=other, side_rows=side_rows)

    def _expert_fn(self, replica_RP, *, remat: bool, lora):
        """The expert function over the owned rows and this forward's replicas (``lora``: the LoRA
        factors of the experts this rank computes, owned then replicas)."""
        if remat:
            rows, spec, source = self.rows, self.spec, self.replicas
            return self.timings.expert_fn(lambda xg, sizes: RematExpertMLP.apply(xg, rows, replica_RP, source, spec,
                                                                                 sizes))
        return self.timings.expert_fn(mlp_fn(self.spec.views(torch.cat([self.rows, replica_RP])), self.spec.activation,
                                             act_params=self.spec.act_params, lora=lora))

    # -- backward ------------------------------------------------------------------------------
    def accumulate_grads(self) -> None:
        """Fold this micro-step's gradients into ``master.grad`` (the replica manager's); the
        reduce's statistics join this iteration's."""
        self.stats.update({"reduce_bytes": 0, "reduce_bytes_sent_local": 0, "reduce_exposed_s": 0.0})
        self.stats.update(self.replicas.accumulate_grads(self.context().timers))  # drops its record

    # -- the record ----------------------------------------------------------------------------
    def _stats(self, got: _Gathered, plan, tokens_ED, *, token_bytes, prediction_error, window, overlap_t: int,
               ctx: StepContext) -> dict:
        layout, gathered, lp = got.layout, got.layouts, got.lp
        rows_D = plan.rows_D().double()
        moved_intra, moved_inter = plan.moved(self.topology.ranks_per_node)
        ep_rows_D = torch.zeros_like(rows_D).index_add_(0, self.owner_E, tokens_ED.sum(1).double())
        mean = float(rows_D.mean())
        psi = self.expert_bytes
        stats = {
            "replicas": layout.added_pairs,
            "evicted_replicas": 0 if lp.evicted_ED is None else int(lp.evicted_ED.sum()),
            "expert_bytes": psi,
            "gather_bytes": sum(g.added_pairs for g in gathered) * psi,
            "gather_bytes_intra": sum(g.intra_pairs for g in gathered) * psi,
            "gather_bytes_inter": sum(g.inter_pairs for g in gathered) * psi,
            "gather_bytes_sent_local": got.sent,
            "gather_exposed_s": got.exposed_s + got.critical_s,
            "post_gating_gather_s": got.critical_s,
            "reduce_bytes": 0,
            "reduce_bytes_sent_local": 0,
            "reduce_exposed_s": 0.0,
            "edp_gather_wait_s": self.replicas.landing_s,  # the rows' last landing (ReplicaManager.land)
            # Forward token exchanges of the whole group (dispatch and combine), by link.
            "a2a_bytes_intra": moved_intra * token_bytes * 2,
            "a2a_bytes_inter": moved_inter * token_bytes * 2,
            "tokens_per_rank": rows_D.long().tolist(),
            "straggler": float(rows_D.max()) / mean if mean > 0 else 1.0,
            "ep_straggler": float(ep_rows_D.max()) / mean if mean > 0 else 1.0,
            "replica_bytes_local": layout.replica_E.numel() * psi,
            "replica_bytes_peak": self.memory.peak,
            "load_prediction_error": prediction_error,
            "window_s": window,
            "overlap_degree": overlap_t,  # the t planned with (the clock's, or searched from it)
        }
        cal = lp.calibration
        if cal is not None:
            stats["calibration"] = {"accepted": cal.accepted, "added_pairs": cal.added_pairs, "saved_s": cal.saved_s,
                                    "extra_s": cal.extra_s, "overlap_degree": cal.overlap_degree,
                                    "evicted_pairs": cal.evicted_pairs}
        if ctx.planner.policy.name == "fastermoe":
            stats["shadowed"] = int(lp.shadow_ED.any(1).sum())
        return stats

    def clear_record(self) -> None:
        """The trace took the last training forward's record (the stage records each once)."""
        self.last_tokens_ED = self.last_decision = None

    # -- state -----------------------------------------------------------------------------------
    def set_owners(self, owner_E: torch.Tensor, *, rows: torch.Tensor, master: torch.Tensor) -> None:
        """Adopt new owners (after a migration moved the rows): between iterations only."""
        if self._gather is not None or self.replicas.busy:
            raise RuntimeError("owners can change only between iterations (a collective is still pending)")
        self.replicas.set_owners(owner_E, rows=rows, master=master)

    def copy_master_to_rows(self) -> None:
        self.replicas.copy_master_to_rows()

    def defer(self, landing) -> None:
        """The rows' pending write, run at their next use (``ReplicaManager.defer``)."""
        self.replicas.defer(landing)

    def land(self) -> None:
        self.replicas.land()

    def export_rows(self) -> torch.Tensor:
        """All experts' rows on every rank (collective): [E, P]."""
        return self.replicas.export_rows(self.group)


def chain(shards: list) -> None:
    """The prefetch chain, in model order: each layer starts the next one's gather when its
    forward is done, and (RM) each one's backward starts the previous one's re-gather."""
    for prev, nxt in zip(shards, shards[1:]):
        prev.next, nxt.prev = nxt, prev
        nxt.replicas.prev = prev.replicas
        prev.replicas.above = nxt.replicas  # gradients in the gaps: each backward completes the layer above


def _dedup_stats(r, plan, *, topology: Topology, token_bytes: int, weight_bytes: int, k: int) -> dict:
    """The group's forward token-exchange bytes (dispatch + combine, rows that change rank) not
    sent thanks to one copy per destination, all links and across nodes (negative where relays'
    forwarding inside nodes cost more than the copies saved), and the routing entries sent
    instead (per row that changes rank: K longs, 2K to a relay, and K weights).
    ``a2a_bytes_intra`` / ``_inter`` count one row per assignment: what crossed is their sum
    minus ``a2a_bytes_saved``, plus ``a2a_meta_bytes``."""
    if not isinstance(r, DedupRoute):
        return {"a2a_bytes_saved": 0, "a2a_bytes_saved_inter": 0, "a2a_meta_bytes": 0}
    off = ~topology.same_node_DD()  # [s, d]: in other nodes
    moved = r.rows_moved()
    inter = sum(int(h.uniq_DD[off].sum()) for h in r.hops)
    moved_intra, moved_inter = plan.moved(topology.ranks_per_node)
    widths = [k * INDEX_BYTES * (1 if i == len(r.hops) - 1 else 2) + k * weight_bytes for i in range(len(r.hops))]
    return {"a2a_bytes_saved": (moved_intra + moved_inter - sum(moved)) * token_bytes * 2,
            "a2a_bytes_saved_inter": (moved_inter - inter) * token_bytes * 2,
            "a2a_meta_bytes": sum(m * w for m, w in zip(moved, widths))}


def _timer(timers, name: str, start: bool) -> None:
    if timers is not None:
        timers(name).start() if start else timers(name).stop()

"""One MoE layer's experts on one rank under FSSDP: owned rows, this iteration's replicas, and the
sparse collectives that move them.

Legend: E experts, D ranks, S owned rows, R replica rows, P elements per expert, T tokens, H hidden.

Per iteration:

* ``prefetch()`` (called before the attention that precedes this layer: by the model's forward
  pre-hook for the first layer, at the end of the previous MoE layer's forward for the others):
  plan the placement from the predicted loads (every rank plans the same one) and start the
  SparseAllGather of the added replicas;
* ``forward()``: all-gather the gate's counts (``tokens_ED``), wait for the replicas (the exposed
  part of the gather is timed), plan the dispatch, exchange tokens, compute owned + replica
  experts, exchange back, start the next layer's gather;
* backward: when the replicas' gradient exists (a post-accumulate-grad hook, or the
  re-materializing expert Function), the SparseReduceScatter starts asynchronously;
  ``accumulate_grads()`` (after the engine's backward) finishes it and folds everything into the
  owner's fp32 gradient.

Re-materialization: the replicas of every layer but the last are freed after its forward and
gathered again (asynchronously) when the following layer's expert backward is done, so they
arrive during the backward of the attention in between.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from deepspeed import comm as dist

from ds_fssdp.comm import all_gather_counts, all_to_all
from ds_fssdp.comm.sparse import SparseAllGather, SparseReduceScatter, Traffic
from ds_fssdp.moe.compute import dispatch_compute_combine, mlp_fn
from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.moe.gate import GateOutput, uniform_assignment
from ds_fssdp.moe.remat import RematExpertMLP
from ds_fssdp.moe.routing import expert_order, route
from ds_fssdp.planner import LoadPredictor, PlacementOptions, gather_layout, place_predicted
from ds_fssdp.planner.dispatch import dispatch_plan
from ds_fssdp.topology import Topology


@dataclass(frozen=True)
class ShardOptions:
    policy: str = "fssdp"
    overlap_degree: int | str = 4  # or "auto": floor(measured window * link_bandwidth / expert bytes)
    budget: int = 2
    placement: str = "joint"  # "cost" | "joint" | "paper" (planner.place)
    dispatch_mode: str = "balanced"  # "balanced" | "balanced-time" | "paper"
    dispatch_slack: float = 0.0
    rematerialize: bool = False
    hierarchical: bool = True  # topology-aware (two-phase) sparse collectives across nodes


@dataclass
class _Iteration:
    """What one forward decided, for an activation-checkpoint recompute to replay."""
    idx_TK: torch.Tensor  # the routing it was given (a recompute must give the same)
    route: object
    layout: object
    replica_RP: torch.Tensor | None  # None under RM: gathered again for the backward
    remat: bool
    hooked: bool  # the replicas' gradient hook is registered (the first pass built a graph)


class ReplicaMemory:
    """Bytes of replica rows alive on this rank (all layers), and the peak since the last reset."""

    def __init__(self):
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def release(self, nbytes: int) -> None:
        self.current -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.current


class ShardedExperts:

    def __init__(self, *, spec: ExpertSpec, layer_index: int, owner_E: torch.Tensor, rows_SP: torch.Tensor,
                 topology: Topology, group, param_group=None, predictor: LoadPredictor,
                 options: ShardOptions = ShardOptions(), memory: ReplicaMemory | None = None, trainable: bool = True):
        self.spec = spec
        self.layer_index = layer_index
        self.topology = topology
        self.group = group
        self.param_group = group if param_group is None else param_group
        self.rank = dist.get_rank(group=group)
        self.options = options
        self.predictor = predictor
        self.memory = memory if memory is not None else ReplicaMemory()
        self.owner_E = owner_E.to("cpu", torch.long).clone()
        self.owned_E = torch.nonzero(self.owner_E == self.rank).flatten()
        if rows_SP.shape != (self.owned_E.numel(), spec.numel):
            raise ValueError(f"rows {tuple(rows_SP.shape)} do not match {self.owned_E.numel()} owned experts "
                             f"of {spec.numel} elements")
        self.trainable = trainable  # False: frozen experts (no gradient, optimizer state or reduce)
        self.rows = rows_SP.detach().requires_grad_(trainable)
        self.master = self.rows  # the optimizer's copy; fp32 beside low-precision rows
        self.next = None  # the following MoE layer (prefetch chain), set by the stage
        self.prev = None
        self.is_last = True
        self.traffic = Traffic(topology.node_D(), self.rank)
        self._gather = None  # (placement_ED, layout, SparseAllGather) started for the next forward
        self._pending = []  # SparseReduceScatters started, not finished
        self._remat = None  # (layout, SparseAllGather or None) for the backward under RM
        self._remat_buffer = None
        self._live = {}  # id -> bytes of replica buffers counted in ``memory``
        self.stats = {}
        self.post_gating = None  # callable (shard, placement_ED, tokens_ED) -> extra_ED | None
        self.post_gating_info = {}  # what the last post-gating decision reports (into ``stats``)
        self.link_bandwidth = None  # bytes/s, measured (for overlap_degree "auto")
        self.cost = None  # planner.CostModel (dispatch "balanced-time"), set by the stage
        self.window_s = None  # the overlap window every rank agreed on at the last step (seconds)
        self.measured_window_s = None  # this rank's moving average of prefetch -> forward
        self._prefetch_t = None
        self.timers = None  # DeepSpeed's SynchronizedWallClockTimer (set by the stage) for exposed waits
        self.last_tokens_ED = None  # the last training forward's all-gathered counts (trace recording)
        self._iterations = []  # _Iteration per recorded forward of this micro-step (replayed by recomputes)

    @property
    def expert_bytes(self) -> int:
        return self.spec.numel * self.rows.element_size()

    # -- placement -----------------------------------------------------------------------------
    @property
    def overlap_degree(self) -> int:
        """t. "auto": the expert chunks the link moves during the measured window (section 4.2);
        0 until the ranks have agreed on a window (after the first optimizer step)."""
        t = self.options.overlap_degree
        if t != "auto":
            return t
        if self.window_s is None or not self.link_bandwidth:
            return 0
        if self.link_bandwidth == float("inf"):
            return self.owner_E.numel()
        return int(self.window_s * self.link_bandwidth // self.expert_bytes)

    def plan_placement(self) -> torch.Tensor:
        o = self.options
        config = PlacementOptions(placement=o.placement, overlap_degree=self.overlap_degree,
                                  materialization_budget=o.budget, policy=o.policy)
        return place_predicted(self.predictor, self.layer_index, self.owner_E, self.topology, config=config,
                               cost=self.cost)

    def _layout(self, placement_ED):
        return gather_layout(self.owner_E, placement_ED, self.rank, topology=self.topology,
                             hierarchical=self.options.hierarchical)

    def _start_gather(self, layout) -> SparseAllGather:
        g = SparseAllGather(self.rows, layout, self.param_group, self.traffic).start()
        self._count(g.replica_RP)
        return g

    def prefetch(self) -> None:
        """Plan this iteration's placement and start its SparseAllGather (asynchronous)."""
        if self._gather is not None:
            return
        self._prefetch_t = time.perf_counter()
        placement_ED = self.plan_placement()
        layout = self._layout(placement_ED)
        self._gather = (placement_ED, layout, self._start_gather(layout))

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x_TH: torch.Tensor, idx_TK: torch.Tensor, weights_TK: torch.Tensor, counts_E: torch.Tensor, *,
                observe: bool = True) -> tuple:
        """Returns ``(out_TH, tokens_ED)``; ``tokens_ED`` is None for a recompute. ``observe``: feed
        this iteration's loads to the predictor (a training forward).

        A forward run inside a backward pass (activation checkpointing recomputing its segment)
        is not a new iteration: it replays the last recorded forward of this layer (same route,
        same replicas, re-gathered under RM) and plans, observes and prefetches nothing."""
        if self._iterations and torch._C._current_graph_task_id() != -1:
            return self._replay(x_TH, idx_TK, weights_TK), None
        gate_idx_TK = idx_TK
        if self.options.policy == "uniform":
            g = uniform_assignment(GateOutput(idx_TK, weights_TK, None, counts_E), self.owner_E.numel(),
                                   offset=self.rank * idx_TK.numel())
            idx_TK, counts_E = g.idx_TK, g.counts_E
        self.prefetch()
        window = time.perf_counter() - self._prefetch_t
        m = self.measured_window_s
        self.measured_window_s = window if m is None else 0.9 * m + 0.1 * window
        (placement_ED, layout, gather), self._gather = self._gather, None
        grouped = expert_order(idx_TK, self.owner_E.numel())  # the route's plan-free half, before the wait
        tokens_ED = all_gather_counts(counts_E, self.group)
        t0 = time.perf_counter()
        self._timer("fssdp_gather_wait", True)
        replica_RP = gather.finish()
        self._timer("fssdp_gather_wait", False)
        gather_exposed = time.perf_counter() - t0
        gather_sent = gather.sent
        extra_ED = self.post_gating(self, placement_ED, tokens_ED) if self.post_gating is not None else None
        critical_s = 0.0
        if extra_ED is not None:
            t1 = time.perf_counter()
            placement_ED, layout, replica_RP, extra_sent = self._gather_extra(placement_ED, layout, replica_RP, extra_ED)
            critical_s = time.perf_counter() - t1
            gather_sent += extra_sent
        plan = dispatch_plan(placement_ED, tokens_ED, self.topology, mode=self.options.dispatch_mode,
                                 cost=self.cost, slack=self.options.dispatch_slack)
        r = route(idx_TK, plan, rank=self.rank, local_E=layout.local_E, grouped=grouped)
        grad = torch.is_grad_enabled()
        # A forward that a backward may follow (or recompute, under checkpointing) is recorded.
        record = grad or observe
        remat = record and self.options.rematerialize and not self.is_last
        hooked = False
        if remat:
            self._remat = (layout, None)
        elif grad and self.trainable:
            # Every rank joins every reduce, so the replicas stay in the graph even when empty.
            self._hook_replicas(replica_RP, layout)
            hooked = True
        out_TH = dispatch_compute_combine(x_TH, weights_TK, r, exchange=self._exchange,
                                          expert_fn=self._expert_fn(replica_RP, remat=remat, local_E=layout.local_E))
        if not record or remat:
            self._uncount(replica_RP)  # freed with this frame (RM: not saved for backward)
        if record:
            self._iterations.append(_Iteration(gate_idx_TK, r, layout, None if remat else replica_RP, remat, hooked))
        if self.next is not None:
            self.next.prefetch()
        prediction_error = float("nan")  # of the loads the plan assumed
        if observe:
            prediction_error = self.predictor.observe(self.layer_index, tokens_ED)
            self.last_tokens_ED = tokens_ED
        self._record(placement_ED, layout, plan, tokens_ED, gather_exposed + critical_s, gather_sent,
                     token_bytes=x_TH.shape[1] * x_TH.element_size())
        self.stats["post_gating_gather_s"] = critical_s
        self.stats["load_prediction_error"] = prediction_error
        self.stats.update(self.post_gating_info)
        self.stats["window_s"] = window
        self.stats["overlap_degree"] = self.overlap_degree
        return out_TH, tokens_ED

    def _replay(self, x_TH, idx_TK, weights_TK) -> torch.Tensor:
        """The recompute of the last recorded forward: same route and replicas, new autograd graph."""
        it = self._iterations.pop()
        if not torch.equal(idx_TK.to(it.idx_TK.device), it.idx_TK):
            raise RuntimeError(f"fssdp layer {self.layer_index}: the recomputed forward routed tokens differently "
                               "from the original one (a non-deterministic router under activation checkpointing; "
                               "keep the checkpoint's preserve_rng_state on)")
        replica_RP = it.replica_RP
        if it.remat:
            replica_RP = self.rematerialized()  # the backward of the same Function reuses it
        elif torch.is_grad_enabled() and self.trainable and not it.hooked:
            self._hook_replicas(replica_RP, it.layout)  # the first pass ran without a graph (reentrant)
        expert_fn = self._expert_fn(replica_RP, remat=it.remat, local_E=it.layout.local_E)
        return dispatch_compute_combine(x_TH, weights_TK, it.route, expert_fn=expert_fn, exchange=self._exchange)

    def _expert_fn(self, replica_RP, *, remat: bool, local_E: torch.Tensor):
        # LoRA factors of the experts this rank computes (owned, then replicas), set per forward
        # by the experts module (integrations/peft_lora.py); LoRA with rematerialize is refused at initialize.
        lora = self.lora_factors(local_E) if getattr(self, "lora_factors", None) is not None else None
        if remat:
            rows, spec = self.rows, self.spec
            return lambda xg, sizes: RematExpertMLP.apply(xg, rows, replica_RP, self, spec, sizes)
        return mlp_fn(self.spec.views(torch.cat([self.rows, replica_RP])), self.spec.activation,
                      act_params=self.spec.act_params, lora=lora)

    def _exchange(self, x, out_splits, in_splits):
        return all_to_all(x, out_splits, in_splits, group=self.group)

    def _hook_replicas(self, replica_RP, layout) -> None:
        replica_RP.requires_grad_(True)
        replica_RP.register_post_accumulate_grad_hook(lambda t, lay=layout: self._replica_backward_done(t, lay))

    def _gather_extra(self, placement_ED, layout, replica_RP, extra_ED):
        """Gather ``extra_ED`` now (critical path) and merge it with the replicas already here
        into one buffer laid out for the final placement (one reduce, one RM re-gather)."""
        from ds_fssdp.planner import shard_placement
        shard_ED = shard_placement(self.owner_E, self.topology.num_ranks)
        delta = self._layout(shard_ED | extra_ED)
        extra = self._start_gather(delta)
        extra_RP = extra.finish()
        placement_ED = placement_ED | extra_ED
        merged = self._layout(placement_ED)
        out_RP = replica_RP.new_empty(merged.replica_E.numel(), replica_RP.shape[1])
        self._count(out_RP)
        for part_RP, part_E in ((replica_RP, layout.replica_E), (extra_RP, delta.replica_E)):
            if part_E.numel():
                pos = torch.searchsorted(merged.replica_E, part_E).to(out_RP.device)
                out_RP.index_copy_(0, pos, part_RP)
            self._uncount(part_RP)
        return placement_ED, merged, out_RP, extra.sent

    # -- backward ------------------------------------------------------------------------------
    def _replica_backward_done(self, replica_RP, layout) -> None:
        self._uncount(replica_RP)  # the backward no longer needs the weights, only their gradient
        self._reduce_start(replica_RP.grad, layout)

    def _reduce_start(self, grad_RP, layout) -> None:
        """This layer's expert backward is done: start its SparseReduceScatter and, under RM, the
        previous layer's re-gather (it overlaps the attention backward in between)."""
        if self.trainable:
            self._pending.append(SparseReduceScatter(grad_RP, layout, self.param_group, self.traffic).start())
        if self.options.rematerialize and self.prev is not None:
            self.prev.start_rematerialize()

    def replica_grad_ready(self, grad_RP) -> None:
        """Called by the re-materializing expert Function once the replicas' gradient exists."""
        layout, _ = self._remat
        self._remat = None
        self._uncount(self._remat_buffer)
        self._remat_buffer = None
        self._reduce_start(grad_RP, layout)

    def start_rematerialize(self) -> None:
        """Start gathering this layer's replicas again for its backward (RM)."""
        if self._remat is None or self._remat[1] is not None:
            return
        layout, _ = self._remat
        self._remat = (layout, self._start_gather(layout))

    def rematerialized(self) -> torch.Tensor:
        if self._remat_buffer is not None:  # a checkpoint recompute fetched it for this backward
            return self._remat_buffer
        layout, pending = self._remat
        if pending is None:  # nobody started it (e.g. no following layer in the backward)
            pending = self._start_gather(layout)
        t0 = time.perf_counter()
        replica_RP = self._remat_buffer = pending.finish()
        self.stats["regather_exposed_s"] = self.stats.get("regather_exposed_s", 0.0) + time.perf_counter() - t0
        return replica_RP

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Fold this micro-step's gradients into ``master.grad``: the owned rows' own gradient and
        the replicas' gradients reduced from other ranks (sums, not yet averaged)."""
        if not self.trainable:
            self._end_micro_step()
            return
        acc_SP = self.master.grad
        if acc_SP is None:
            acc_SP = self.master.grad = torch.zeros_like(self.master)
        if self.master is not self.rows and self.rows.grad is not None:
            acc_SP += self.rows.grad.to(acc_SP.dtype)
            self.rows.grad = None
        t0 = time.perf_counter()
        self._timer("fssdp_reduce_wait", True)
        for reducer in self._pending:
            rows_S, grad_SP = reducer.finish()
            acc_SP.index_add_(0, rows_S, grad_SP.to(acc_SP.dtype))
        self._timer("fssdp_reduce_wait", False)
        self.stats["reduce_exposed_s"] = time.perf_counter() - t0
        if self._pending:
            self.stats["reduce_bytes"] = sum(r.layout.added_pairs for r in self._pending) * self.expert_bytes
            self.stats["reduce_bytes_sent_local"] = sum(r.sent for r in self._pending)
        self._end_micro_step()

    def _end_micro_step(self) -> None:
        self._pending = []
        self._remat = None
        self._iterations = []
        for nbytes in self._live.values():
            self.memory.release(nbytes)
        self._live = {}

    # -- bookkeeping ---------------------------------------------------------------------------
    def _timer(self, name: str, start: bool) -> None:
        if self.timers is not None:
            self.timers(name).start() if start else self.timers(name).stop()

    def _count(self, replica_RP) -> None:
        nbytes = replica_RP.numel() * replica_RP.element_size()
        self.memory.add(nbytes)
        self._live[id(replica_RP)] = nbytes

    def _uncount(self, replica_RP) -> None:
        nbytes = self._live.pop(id(replica_RP), None)
        if nbytes is not None:
            self.memory.release(nbytes)

    def _record(self, placement_ED, layout, plan, tokens_ED, gather_exposed, gather_sent, *,
                token_bytes) -> None:
        rows_D = plan.rows_D().double()
        moved_intra, moved_inter = plan.moved(self.topology.ranks_per_node)
        ep_rows_D = torch.zeros_like(rows_D).index_add_(0, self.owner_E, tokens_ED.sum(1).double())
        mean = float(rows_D.mean())
        self.stats = {
            "replicas": layout.added_pairs,
            "expert_bytes": self.expert_bytes,
            "gather_bytes": layout.added_pairs * self.expert_bytes,
            "gather_bytes_intra": layout.intra_pairs * self.expert_bytes,
            "gather_bytes_inter": layout.inter_pairs * self.expert_bytes,
            "gather_bytes_sent_local": gather_sent,
            "gather_exposed_s": gather_exposed,
            "reduce_bytes": 0,
            "reduce_bytes_sent_local": 0,
            "reduce_exposed_s": 0.0,
            # Forward token exchanges of the whole group (dispatch and combine), by link.
            "a2a_bytes_intra": moved_intra * token_bytes * 2,
            "a2a_bytes_inter": moved_inter * token_bytes * 2,
            "tokens_per_rank": rows_D.long().tolist(),
            "straggler": float(rows_D.max()) / mean if mean > 0 else 1.0,
            "ep_straggler": float(ep_rows_D.max()) / mean if mean > 0 else 1.0,
            "replica_bytes_local": layout.replica_E.numel() * self.expert_bytes,
            "replica_bytes_peak": self.memory.peak,
        }

    # -- state -----------------------------------------------------------------------------------
    def set_owners(self, owner_E: torch.Tensor, *, rows: torch.Tensor, master: torch.Tensor) -> None:
        """Adopt new owners (after a migration moved the rows): between iterations only."""
        if self._gather is not None or self._pending or self._remat is not None:
            raise RuntimeError("owners can change only between iterations (a collective is still pending)")
        self.owner_E = owner_E.to("cpu", torch.long).clone()
        self.owned_E = torch.nonzero(self.owner_E == self.rank).flatten()
        if not self.trainable:
            same = master is rows
            rows = rows.detach()
            master = rows if same else master.detach()
        self.rows, self.master = rows, master

    def use_precision(self, dtype: torch.dtype, device) -> None:
        """Compute with ``dtype`` rows on ``device``; keep an fp32 master when ``dtype`` is lower."""
        fp32 = self.master.detach().to(device=device, dtype=torch.float32)
        grad = self.trainable
        self.rows = fp32.to(dtype).requires_grad_(grad) if dtype != torch.float32 else fp32.requires_grad_(grad)
        self.master = self.rows if dtype == torch.float32 else fp32.clone().requires_grad_(grad)

    @torch.no_grad()
    def copy_master_to_rows(self) -> None:
        if self.master is not self.rows:
            self.rows.copy_(self.master)

    @torch.no_grad()
    def load_rows(self, full_EP: torch.Tensor) -> None:
        """Keep the owned experts' rows of a full [E, P] tensor (in master and rows)."""
        own = full_EP.to(self.master.device).index_select(0, self.owned_E.to(self.master.device))
        self.master.copy_(own)
        self.copy_master_to_rows()

    @torch.no_grad()
    def export_rows(self) -> torch.Tensor:
        """All experts' rows on every rank (collective): [E, P]."""
        full_EP = self.master.new_zeros(self.owner_E.numel(), self.spec.numel)
        full_EP[self.owned_E.to(full_EP.device)] = self.master.detach()
        dist.all_reduce(full_EP, group=self.group)
        return full_EP

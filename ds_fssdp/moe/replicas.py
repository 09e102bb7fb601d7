"""One layer's expert rows on one rank and the replicas that visit it: the sparse collectives,
re-materialization and memory accounting (Megatron-Core's "experts" part of a layer; docs/design.md
section 4, and section 2 for the rows' landing).

Legend: E experts, D ranks, S owned rows, R replica rows, P elements per expert.

* the owned rows (``rows``, with an fp32 ``master`` beside low-precision rows) and their owners;
* :meth:`start_gather` / :meth:`gather_now`: a SparseAllGather of a layout's replicas;
* :meth:`hook_replicas`: their SparseReduceScatter starts when their gradient exists;
  :meth:`accumulate_grads` folds everything into ``master.grad`` (with gradients in the gaps, during
  the backward: :meth:`backward_done_below`, chained by ``above``);
* re-materialization: replicas dropped after the forward, gathered again when the following
  layer's expert backward is done (:meth:`start_rematerialize`, chained by ``prev``);
* the rows' landing: a write left in flight by the step (:meth:`defer`) runs before anything here
  reads or writes the rows (:meth:`land`; reading their shape, dtype or size does not land it);
* :class:`ReplicaMemory`: replica bytes alive on this rank (all layers), their peak, and how many
  layers' replicas are alive at once.

What a forward leaves for its backward is kept per micro-batch in ``records`` (``moe/records.py``),
so several forwards may be in flight (DeepSpeed's pipeline engine, 1F1B). No decisions are made
here: layouts come from the planner's placements.
"""
from __future__ import annotations

import time
from collections import Counter

import torch
from deepspeed import comm as dist

from ds_fssdp.comm.sparse import SparseAllGather, SparseReduceScatter
from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.moe.records import MicrobatchRecords, MicroRecord
from ds_fssdp.planner import gather_layout, shard_placement
from ds_fssdp.topology import Topology


class ReplicaMemory:
    """Bytes of replica rows alive on this rank (all layers), and the peak since the last reset;
    ``layers_peak``: the most layers with replica buffers alive at once (``owner``: the layer's
    manager; buffers of no rows count no layer)."""

    def __init__(self):
        self.current = 0
        self.peak = 0
        self._by_layer = Counter()  # id(owner) -> live buffers with rows
        self.layers_peak = 0

    def add(self, nbytes: int, owner=None) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        if owner is not None and nbytes:
            self._by_layer[id(owner)] += 1
            self.layers_peak = max(self.layers_peak, len(self._by_layer))

    def release(self, nbytes: int, owner=None) -> None:
        self.current -= nbytes
        if owner is not None and nbytes:
            self._by_layer -= Counter([id(owner)])  # drops a layer at 0

    def reset_peak(self) -> None:
        self.peak = self.current
        self.layers_peak = len(self._by_layer)


class ReplicaManager:

    def __init__(self, *, spec: ExpertSpec, owner_E: torch.Tensor, rows_SP: torch.Tensor, topology: Topology,
                 param_group, rank: int, memory: ReplicaMemory, trainable: bool, hierarchical: bool,
                 rematerialize: bool, records: MicrobatchRecords | None = None, gaps=None):
        """``records``: the layer's per-micro-batch records (shared with its ``ShardedExperts``;
        None: its own). ``gaps``: gradients in the gaps, a callable returning this micro-step's
        callable() to call once the owned gradient is final (``StepContext.gaps``), or None."""
        self.spec = spec
        self.topology = topology
        self.param_group = param_group
        self.rank = rank
        self.memory = memory
        self.hierarchical = hierarchical  # topology-aware (two-phase) sparse collectives across nodes
        self.rematerialize = rematerialize
        self.owner_E = owner_E.to("cpu", torch.long).clone()
        self.owned_E = torch.nonzero(self.owner_E == rank).flatten()
        if rows_SP.shape != (self.owned_E.numel(), spec.numel):
            raise ValueError(f"rows {tuple(rows_SP.shape)} do not match {self.owned_E.numel()} owned experts "
                             f"of {spec.numel} elements")
        self.trainable = trainable  # False: frozen experts (no gradient, optimizer state or reduce)
        self.rows = rows_SP.detach().requires_grad_(trainable)
        self.master = self.rows  # the optimizer's copy; fp32 beside low-precision rows
        self.prev = None  # the previous layer's manager (RM: its re-gather starts when this backward is done)
        self.above = None  # the next layer's manager (gradients in the gaps: folded when this backward is done)
        self.gaps = gaps
        self.records = records if records is not None else MicrobatchRecords()
        self._folded = None  # the fold's statistics once done during the backward
        self.pending = []  # SparseReduceScatters started by the backward in progress, not finished
        # id -> (bytes, record) of replica buffers counted in ``memory``; the record is the
        # micro-batch keeping it alive (None: the forward in progress, until it records)
        self._live = {}
        self.regather_exposed_s = 0.0
        self._landing = None  # callable(): the rows' pending write (``defer``), or None
        self.landing_s = 0.0  # seconds the last landing took (its wait, update and copy); 0 until it runs

    @property
    def expert_bytes(self) -> int:
        return self.spec.numel * self.rows.element_size()

    @property
    def busy(self) -> bool:
        """A collective of this layer is pending (owners may change only when not)."""
        return bool(self.pending) or any(r.remat is not None for r in self.records)

    # -- gathers ---------------------------------------------------------------------------------
    def layout(self, placement_ED):
        return gather_layout(self.owner_E, placement_ED, self.rank, topology=self.topology,
                             hierarchical=self.hierarchical)

    # -- the rows' landing ---------------------------------------------------------------------------
    @property
    def landing(self) -> bool:
        """A write of the rows is pending (:meth:`defer`), not landed yet."""
        return self._landing is not None

    def defer(self, landing) -> None:
        """``landing()`` writes the rows (it waits for the collective it was started with); it runs
        at the rows' next use (:meth:`land`), not now."""
        self.land()
        self._landing = landing
        self.landing_s = 0.0

    def stepped(self, *, deferred: bool) -> None:
        """The optimizer step is done: it left the rows to land at their next use (``deferred``,
        :meth:`defer`) or wrote them itself (no landing to time next)."""
        if not deferred:
            self.landing_s = 0.0

    @torch.no_grad()
    def land(self) -> None:
        """Run the pending write of the rows, if any (every use of the rows calls this first).
        Outside inference mode even when called in it (an evaluation forward): a split step's
        landing steps the optimizer, whose state must not be created as inference tensors."""
        if self._landing is None:
            return
        landing, self._landing = self._landing, None
        t0 = time.perf_counter()
        with torch.inference_mode(False):
            landing()
        self.landing_s = time.perf_counter() - t0

    def start_gather(self, layout, record: MicroRecord | None = None) -> SparseAllGather:
        """``record``: the micro-batch whose backward keeps the buffer (None: the forward's)."""
        self.land()
        g = SparseAllGather(self.rows, layout, self.param_group).start()
        self.count(g.replica_RP, record)
        return g

    def gather_now(self, placement_ED, layout, replica_RP, extra_ED, drop_ED=None):
        """Gather ``extra_ED`` now (critical path) and merge it with the replicas already here
        into one buffer laid out for the final placement (one reduce, one RM re-gather);
        ``drop_ED``: replicas already here that calibration evicted (left out of the buffer, so
        neither reduced nor re-gathered; their rows are freed with the old buffer).
        Returns (placement_ED, layout, replica_RP, the extra gather's layout, bytes this rank sent)."""
        shard_ED = shard_placement(self.owner_E, self.topology.num_ranks)
        delta = self.layout(shard_ED | extra_ED)
        extra = self.start_gather(delta)
        extra_RP = extra.finish()
        if drop_ED is not None:  # LayerPlan.evicted_ED: never the shard
            placement_ED = placement_ED & ~drop_ED
        placement_ED = placement_ED | extra_ED
        merged = self.layout(placement_ED)
        out_RP = replica_RP.new_empty(merged.replica_E.numel(), replica_RP.shape[1])
        self.count(out_RP)
        for part_RP, part_E in ((replica_RP, layout.replica_E), (extra_RP, delta.replica_E)):
            keep = torch.isin(part_E, merged.replica_E)  # all but the evicted
            if bool(keep.any()):
                pos = torch.searchsorted(merged.replica_E, part_E[keep]).to(out_RP.device)
                out_RP.index_copy_(0, pos, part_RP if bool(keep.all()) else part_RP[keep.to(part_RP.device)])
            self.uncount(part_RP)
        return placement_ED, merged, out_RP, delta, extra.sent

    # -- backward --------------------------------------------------------------------------------
    def hook_replicas(self, replica_RP, layout) -> None:
        """Every rank joins every reduce, so the replicas stay in the graph even when empty."""
        self.records.forward_record().expected += 1
        replica_RP.requires_grad_(True)

        def done(t):
            self.uncount(t)  # the backward no longer needs the weights, only their gradient
            self._reduce_start(t.grad, layout)
        replica_RP.register_post_accumulate_grad_hook(done)

    def _reduce_start(self, grad_RP, layout) -> None:
        """This layer's expert backward is done: start its SparseReduceScatter and, under RM, the
        previous layer's re-gather (it overlaps the attention backward in between)."""
        if self.trainable:
            if self._folded is not None:  # the gradient was declared final: its EDP reduce is running
                raise RuntimeError("fssdp: a replica reduce started after this layer's gradient was folded during the "
                                   "backward (gradients in the gaps); set fssdp.grads_in_gaps to false for this model")
            self.pending.append(SparseReduceScatter(grad_RP, layout, self.param_group).start())
        if self.rematerialize and self.prev is not None:
            self.prev.start_rematerialize()
        if self.above is not None:
            self.above.backward_done_below()

    def backward_done_below(self) -> None:
        """Gradients in the gaps: the backward has reached the layer below, so this layer's owned
        gradient of this micro-step is accumulated (its leaves' accumulation runs first) and its
        replica reduces have started: land them, fold them in, tell ``gaps``. Only when every
        reduce this backward starts has started (else :meth:`accumulate_grads` folds, as without)."""
        if self.gaps is None or self._folded is not None or not self.trainable:
            return
        gaps = self.gaps()
        if gaps is None:
            return
        record = self.records.backward_record()
        expected = record.expected if record is not None else 0
        if not expected or len(self.pending) != expected:
            return
        self._folded = self._fold(None, in_backward=True)
        gaps()

    def drop_for_backward(self, layout) -> None:
        """RM: the replicas of this forward are freed; the backward gathers ``layout`` again."""
        record = self.records.forward_record()
        if self.trainable and torch.is_grad_enabled():
            record.expected += 1
        record.remat = (layout, None)

    def replica_grad_ready(self, grad_RP) -> None:
        """Called by the re-materializing expert Function once the replicas' gradient exists."""
        record = self.records.backward_record()
        layout, _ = record.remat
        record.remat = None
        self.uncount(record.remat_buffer)
        record.remat_buffer = None
        self._reduce_start(grad_RP, layout)

    def start_rematerialize(self) -> None:
        """Start gathering this layer's replicas again for its backward (RM): those of the
        micro-batch whose backward runs."""
        record = self.records.backward_record()
        if record is None or record.remat is None or record.remat[1] is not None:
            return
        layout, _ = record.remat
        record.remat = (layout, self.start_gather(layout, record))

    def rematerialized(self) -> torch.Tensor:
        record = self.records.backward_record()
        if record.remat_buffer is not None:  # a checkpoint recompute fetched it for this backward
            return record.remat_buffer
        layout, pending = record.remat
        if pending is None:  # nobody started it (e.g. no following layer in the backward)
            pending = self.start_gather(layout, record)
        t0 = time.perf_counter()
        replica_RP = record.remat_buffer = pending.finish()
        self.regather_exposed_s += time.perf_counter() - t0
        return replica_RP

    @torch.no_grad()
    def accumulate_grads(self, timer=None) -> dict:
        """Fold this micro-step's gradients into ``master.grad``: the owned rows' own gradient and
        the replicas' gradients reduced from other ranks (sums, not yet averaged). Returns the
        reduce's statistics. ``timer``: DeepSpeed's timers (the exposed wait), or None."""
        if not self.trainable:
            self.end_micro_step()
            return {}
        stats = self._folded if self._folded is not None else self._fold(timer)
        self.end_micro_step()
        return stats

    @torch.no_grad()
    def _fold(self, timer, *, in_backward: bool = False) -> dict:
        """The owned rows' gradient and the landed replica reduces into ``master.grad`` (in this
        order, whenever it runs: the same sums)."""
        acc_SP = self.master.grad
        if acc_SP is None:
            acc_SP = self.master.grad = torch.zeros_like(self.master)
        if self.master is not self.rows and self.rows.grad is not None:
            acc_SP += self.rows.grad.to(acc_SP.dtype)
            self.rows.grad = None
        t0 = time.perf_counter()
        if timer is not None:
            timer("fssdp_reduce_wait").start()
        for reducer in self.pending:
            rows_S, grad_SP = reducer.finish()
            acc_SP.index_add_(0, rows_S, grad_SP.to(acc_SP.dtype))
        if timer is not None:
            timer("fssdp_reduce_wait").stop()
        stats = {"reduce_exposed_s": time.perf_counter() - t0}
        if self.pending:
            stats["reduce_bytes"] = sum(r.layout.added_pairs for r in self.pending) * self.expert_bytes
            stats["reduce_bytes_sent_local"] = sum(r.sent for r in self.pending)
        if self.regather_exposed_s:
            stats["regather_exposed_s"] = self.regather_exposed_s
        stats["folded_in_backward"] = in_backward
        return stats

    def end_micro_step(self) -> None:
        """The backward in progress is done: its record is dropped and the buffers it kept are
        released (with no forward left in flight, also those of no record)."""
        self.pending = []
        self._folded = None
        self.regather_exposed_s = 0.0
        done = self.records.end_backward()
        last = not len(self.records)
        for key, (nbytes, record) in list(self._live.items()):
            if record is done or (last and record is None):
                del self._live[key]
                self.memory.release(nbytes, self)

    # -- memory ----------------------------------------------------------------------------------
    def count(self, replica_RP, record: MicroRecord | None = None) -> None:
        """``record``: the micro-batch whose backward keeps the buffer (None: the forward in
        progress, :meth:`adopt` assigns it)."""
        nbytes = replica_RP.numel() * replica_RP.element_size()
        self.memory.add(nbytes, self)
        self._live[id(replica_RP)] = (nbytes, record)

    def adopt(self, record: MicroRecord) -> None:
        """The forward in progress recorded ``record``: the buffers it still counts are kept for
        that micro-batch's backward."""
        for key, (nbytes, owner) in self._live.items():
            if owner is None:
                self._live[key] = (nbytes, record)

    def uncount(self, replica_RP) -> None:
        entry = self._live.pop(id(replica_RP), None)
        if entry is not None:
            self.memory.release(entry[0], self)

    # -- owned state -----------------------------------------------------------------------------
    def set_owners(self, owner_E: torch.Tensor, *, rows: torch.Tensor, master: torch.Tensor) -> None:
        """Adopt new owners (after a migration moved the rows): between iterations only."""
        self.land()
        self.owner_E = owner_E.to("cpu", torch.long).clone()
        self.owned_E = torch.nonzero(self.owner_E == self.rank).flatten()
        if not self.trainable:
            same = master is rows
            rows = rows.detach()
            master = rows if same else master.detach()
        self.rows, self.master = rows, master

    def use_precision(self, dtype: torch.dtype, device) -> None:
        """Compute with ``dtype`` rows on ``device``; keep an fp32 master when ``dtype`` is lower."""
        self.land()
        fp32 = self.master.detach().to(device=device, dtype=torch.float32)
        grad = self.trainable
        self.rows = fp32.to(dtype).requires_grad_(grad) if dtype != torch.float32 else fp32.requires_grad_(grad)
        self.master = self.rows if dtype == torch.float32 else fp32.clone().requires_grad_(grad)

    @torch.no_grad()
    def copy_master_to_rows(self) -> None:
        self.land()
        if self.master is not self.rows:
            self.rows.copy_(self.master)

    @torch.no_grad()
    def export_rows(self, group) -> torch.Tensor:
        """All experts' rows on every rank (collective over ``group``): [E, P]."""
        self.land()
        full_EP = self.master.new_zeros(self.owner_E.numel(), self.spec.numel)
        full_EP[self.owned_E.to(full_EP.device)] = self.master.detach()
        dist.all_reduce(full_EP, group=group)
        return full_EP

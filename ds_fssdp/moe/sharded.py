"""One MoE layer's experts on one rank under FSSDP: owned rows, this iteration's replicas, and the
sparse collectives that move them.

Legend: E experts, D ranks, S owned rows, R replica rows, P elements per expert, T tokens, H hidden.

Per forward: plan the placement from the predicted loads (every rank plans the same one), start
the SparseAllGather of the added replicas, all-gather the gate's counts (``tokens_ED``), wait for
the replicas, plan the dispatch, exchange tokens, compute owned + replica experts, exchange back.
After the backward, ``drain_replica_grads`` runs the SparseReduceScatter that returns every
replica's gradient to the owner of its expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from deepspeed import comm as dist

from ds_fssdp.comm import all_gather_counts, all_to_all, sparse_all_gather, sparse_reduce_scatter
from ds_fssdp.moe.compute import dispatch_compute_combine
from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.moe.gate import GateOutput
from ds_fssdp.moe.routing import route
from ds_fssdp.planner import GatherLayout, LoadPredictor, dispatch, gather_layout, plan_placement
from ds_fssdp.planner.joint import joint_materialize
from ds_fssdp.topology import Topology


@dataclass
class _Gather:
    placement_ED: torch.Tensor
    layout: GatherLayout
    handle: object
    bytes_sent: int


class ShardedExperts:

    def __init__(self, *, spec: ExpertSpec, layer_index: int, owner_E: torch.Tensor, rows_SP: torch.Tensor,
                 topology: Topology, group, policy: str, overlap_degree: int, budget: int,
                 predictor: LoadPredictor, placement: str = "joint", dispatch_mode: str = "balanced"):
        self.spec = spec
        self.layer_index = layer_index
        self.topology = topology
        self.group = group
        self.rank = dist.get_rank(group=group)
        self.policy = policy
        self.overlap_degree = overlap_degree
        self.budget = budget
        self.predictor = predictor
        self.placement = placement
        self.dispatch_mode = dispatch_mode
        self.owner_E = owner_E.to("cpu", torch.long).clone()
        self.owned_E = torch.nonzero(self.owner_E == self.rank).flatten()
        if rows_SP.shape != (self.owned_E.numel(), spec.numel):
            raise ValueError(f"rows {tuple(rows_SP.shape)} do not match {self.owned_E.numel()} owned experts "
                             f"of {spec.numel} elements")
        self.rows = rows_SP.detach().requires_grad_(True)
        self.master = self.rows  # the optimizer's copy; fp32 beside low-precision rows
        self._gather = None
        self._pending = []  # (replica leaf, layout) of forwards whose gradients are not reduced yet
        self.stats = {}

    @property
    def expert_bytes(self) -> int:
        return self.spec.numel * self.rows.element_size()

    def plan_placement(self) -> torch.Tensor:
        if self.policy == "fssdp" and self.placement == "joint":
            tokens_ED = self.predictor.predict_tokens(self.layer_index)
            if tokens_ED is not None:
                return joint_materialize(self.owner_E, tokens_ED, self.topology, overlap_degree=self.overlap_degree,
                                         budget=self.budget)
        load_E = self.predictor.predict(self.layer_index)
        return plan_placement(self.policy, self.owner_E, load_E, self.topology,
                              overlap_degree=self.overlap_degree, budget=self.budget)

    def prefetch(self) -> None:
        """Plan this iteration's placement and start its SparseAllGather (asynchronous)."""
        placement_ED = self.plan_placement()
        layout = gather_layout(self.owner_E, placement_ED, self.rank)
        handle, sent = sparse_all_gather(self.rows, layout, self.group)
        self._gather = _Gather(placement_ED, layout, handle, sent)

    def forward(self, x_TH: torch.Tensor, gate: GateOutput, *, observe: bool = True) -> tuple:
        """Returns (out_TH, tokens_ED). ``observe``: feed this iteration's loads to the predictor."""
        if self._gather is None:
            self.prefetch()
        g, self._gather = self._gather, None
        tokens_ED = all_gather_counts(gate.counts_E, self.group)
        replica_RP = g.handle.wait()
        # Every rank joins every SparseReduceScatter, so a forward is tracked even where this rank
        # received no replica.
        track = torch.is_grad_enabled()
        if track:
            replica_RP.requires_grad_(True)
        plan_EDD = dispatch(g.placement_ED, tokens_ED, self.topology, mode=self.dispatch_mode)
        r = route(gate.idx_TK, plan_EDD, rank=self.rank, local_E=g.layout.local_E)
        local_SP = torch.cat([self.rows, replica_RP]) if replica_RP.shape[0] else self.rows
        exchange = lambda x, out_splits, in_splits: all_to_all(x, out_splits, in_splits, group=self.group)
        out_TH = dispatch_compute_combine(x_TH, gate.weights_TK, r, expert_weights=self.spec.views(local_SP),
                                          activation=self.spec.activation, exchange=exchange)
        if track:
            self._pending.append((replica_RP, g.layout))
        if observe:
            self.predictor.observe(self.layer_index, tokens_ED)
        rows_D = plan_EDD.sum((0, 1)).double()
        ep_rows_D = torch.zeros_like(rows_D).index_add_(0, self.owner_E, tokens_ED.sum(1).double())
        mean = float(rows_D.mean())
        self.stats = {
            "replicas": g.layout.added_pairs,
            "expert_bytes": self.expert_bytes,
            "gather_bytes": g.layout.added_pairs * self.expert_bytes,
            "gather_bytes_sent_local": g.bytes_sent,
            "reduce_bytes": 0,
            "reduce_bytes_sent_local": 0,
            "tokens_per_rank": rows_D.long().tolist(),
            "straggler": float(rows_D.max()) / mean if mean > 0 else 1.0,
            "ep_straggler": float(ep_rows_D.max()) / mean if mean > 0 else 1.0,
        }
        return out_TH, tokens_ED

    def drain_replica_grads(self) -> list:
        """SparseReduceScatter of every pending forward's replica gradients.

        Returns [(owned row indices, gradients)] to be summed into the owned rows' gradient. A
        replica that received no tokens contributes zeros (the exchange is collective, so every
        rank takes part in every pending one)."""
        results, sent, volume = [], 0, 0
        for replica_RP, layout in self._pending:
            volume += layout.added_pairs * self.expert_bytes
            grad_RP = replica_RP.grad if replica_RP.grad is not None else torch.zeros_like(replica_RP)
            handle, nbytes = sparse_reduce_scatter(grad_RP.detach(), layout, self.group)
            results.append(handle)
            sent += nbytes
        self._pending = []
        out = [h.wait() for h in results]
        if results:
            self.stats["reduce_bytes"] = volume
            self.stats["reduce_bytes_sent_local"] = sent
        return out

    def use_precision(self, dtype: torch.dtype, device) -> None:
        """Compute with ``dtype`` rows on ``device``; keep an fp32 master when ``dtype`` is lower."""
        fp32 = self.master.detach().to(device=device, dtype=torch.float32)
        self.rows = fp32.to(dtype).requires_grad_(True) if dtype != torch.float32 else fp32.requires_grad_(True)
        self.master = self.rows if dtype == torch.float32 else fp32.clone().requires_grad_(True)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Fold this micro-step's gradients into ``master.grad``: the owned rows' own gradient and
        the replicas' gradients reduced from other ranks (sums, not yet averaged)."""
        acc_SP = self.master.grad
        if acc_SP is None:
            acc_SP = self.master.grad = torch.zeros_like(self.master)
        if self.master is not self.rows and self.rows.grad is not None:
            acc_SP += self.rows.grad.to(acc_SP.dtype)
            self.rows.grad = None
        for rows_S, grad_SP in self.drain_replica_grads():
            acc_SP.index_add_(0, rows_S, grad_SP.to(acc_SP.dtype))

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

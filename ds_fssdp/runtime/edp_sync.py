"""The plan for the next step's expert-data-parallel (EDP) sync under ``fssdp.grads_in_gaps``:
each layer's gap reduce slice and whether the sync is split around the step.

The stage builds one :class:`EDPSyncPlan` at attach and calls it at three points: after each
backward it records this rank's load of every layer (:meth:`EDPSyncPlan.record_loads`); after each
step it decides whether the next step's sync is split (:meth:`EDPSyncPlan.decide_split`, handed to
``expert_state.split``) and plans each layer's slice (:meth:`EDPSyncPlan.plan_slices`); during the
backward each layer's gap reduce takes its slice (:meth:`EDPSyncPlan.layer_slice_bytes`). The
modelling is local (``planner/schedule.py``); each decision is then agreed in one all-reduce (the
minimum) over the EDP group, because every member must issue the same collectives. The
collectives themselves run in ``runtime/expert_dp.py``.

Nothing is planned without gradients in the gaps, with one FSSDP group or without a cost model:
every slice is then the fixed default and no step is split.
"""
from __future__ import annotations

import torch
from deepspeed import comm as dist

from ds_fssdp.planner.schedule import (gap_slice_bytes, idle_link_s, loads_from_traffic, split_sync_inputs,
                                       split_sync_pays)

# Expert optimizers a split step may step one layer at a time (expert_dp.py), exactly as in one
# step of all: torch's keep every state per parameter. DeepSpeed's FusedAdam counts its step in the
# last parameter of a group that has a gradient and applies that count to all: never split for it.
STEPS_ONE_LAYER = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class EDPSyncPlan:
    """The EDP sync's slices and split flag for the next step, from the last step's loads.

    ``shards``: every layer's ``ShardedExperts``, ``edp_group`` / ``edp_size``: the ranks at this
    rank's position in every FSSDP group, ``grads_in_gaps``: the config flag, ``cost``: the
    stage's cost model (None: none configured or measured), ``partitioned``: the expert state is
    partitioned over the EDP group (ZeRO >= 1), ``optimizer``: the expert optimizer (None: every
    expert frozen), ``ranks_per_node``: the FSSDP group's topology, ``grad_bytes``: bytes per
    element the sync sends (its communication dtype's, ``planner/sync_dtype.py``; 2 in bf16)."""

    def __init__(self, shards: list, *, edp_group, edp_size: int, grads_in_gaps: bool, cost, partitioned: bool,
                 optimizer, ranks_per_node: int, grad_bytes: int):
        self.shards = list(shards)
        self.grad_bytes = int(grad_bytes)
        self.edp_group, self.edp_size = edp_group, edp_size
        self.cost = cost
        self.partitioned = partitioned
        self.optimizer_steps_one_layer = type(optimizer) in STEPS_ONE_LAYER
        self.ranks_per_node = ranks_per_node
        self.planned = bool(grads_in_gaps) and edp_size > 1 and cost is not None
        # Each layer's gap reduce slice, bytes per rank (None: not planned yet, the default),
        # agreed over the EDP group; and what the next plan is made from (this rank's load of
        # each layer in the last training forward, planner.schedule.LayerLoad or None, and the
        # (forward, backward) pipeline degrees it ran at).
        self.slice_bytes = [None] * len(self.shards)
        self.loads = [None] * len(self.shards)
        self.degrees = [(1, 1)] * len(self.shards)

    def layer_slice_bytes(self, i: int) -> int:
        """Layer ``i``'s gap reduce slice in bytes per rank: the planned one, else the documented
        default (first step, or no costs)."""
        nbytes = self.slice_bytes[i]
        if nbytes is None:
            nbytes = gap_slice_bytes(None, None, self.shards[i].rows.numel() * self.grad_bytes)
        return nbytes

    def record_loads(self) -> None:
        """After a backward: this rank's load of each layer's last training forward (when planned)."""
        if self.planned:
            self.loads = [self._rank_load(s) for s in self.shards]
            self.degrees = [(1, 1) if s.last_decision is None else s.last_decision.degrees for s in self.shards]

    def _rank_load(self, shard):
        """This rank's load of a layer's last training forward (its plan's traffic), or None."""
        d = shard.last_decision
        if d is None:
            return None
        token_bytes = shard.spec.cost_shape(shard.rows.element_size()).token_bytes
        return loads_from_traffic(d.traffic_DD.numpy(), ranks_per_node=self.ranks_per_node,
                                  token_bytes=token_bytes)[shard.rank]

    def _idle_s(self, schedule_costs, *, backward: bool) -> list:
        """Each layer's link gap (:func:`idle_link_s` of its last load at the pipeline degree it ran
        at in that direction; None without a load), from the costs the schedule is planned with
        (``schedule_costs``; None: the cost model's)."""
        costs = schedule_costs if schedule_costs is not None else self.cost.schedule_costs()
        return [None if ld is None else idle_link_s(costs, ld, max(1, deg[1 if backward else 0]), backward=backward)
                for ld, deg in zip(self.loads, self.degrees)]

    def plan_slices(self, device, *, split: bool, schedule_costs) -> None:
        """Each layer's EDP reduce slice for the next step: :func:`planner.schedule.gap_slice_bytes`
        over the gap the layer below's backward leaves on the links (:func:`idle_link_s` of its
        last load at its degree) and the modelled reduce (a reduce-scatter when partitioned or
        ``split``); the smallest over the EDP group (every member must cut the same slices).
        Without a plan: the fixed default (no collective)."""
        if not self.planned:
            return
        reduce = self.cost.edp_reduce_linear(self.edp_size, partitioned=self.partitioned or split)
        idle = self._idle_s(schedule_costs, backward=True)
        sizes = [gap_slice_bytes(reduce, idle[i - 1] if i > 0 else None, s.rows.numel() * self.grad_bytes)
                 for i, s in enumerate(self.shards)]
        agreed = torch.tensor(sizes, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.edp_group)
        self.slice_bytes = [int(v) for v in agreed.tolist()]

    def split_inputs(self, *, attention_s: list, schedule_costs):
        """:func:`split_sync_inputs` for the next step: each layer's gradient reduced over the EDP
        group (``grad_bytes`` per element) at the modelled costs, its backward gap (twice its attention window
        ``attention_s`` and the link gap of its last load's backward) and forward gap (its window
        and its forward's link gap). None where one is missing (no attention window or no load yet)."""
        if any(a is None for a in attention_s) or any(ld is None for ld in self.loads):
            return None
        n = self.edp_size
        part = self.cost.edp_reduce_linear(n, partitioned=True)
        backward = [2.0 * a + g for a, g in zip(attention_s, self._idle_s(schedule_costs, backward=True))]
        forward = [a + g for a, g in zip(attention_s, self._idle_s(schedule_costs, backward=False))]
        return split_sync_inputs([s.rows.numel() for s in self.shards], self.grad_bytes, backward, forward,
                                 allreduce=self.cost.edp_reduce_linear(n, partitioned=False),
                                 reduce_scatter=lambda b: part(b / n))

    @property
    def may_split(self) -> bool:
        """Whether a step may be split: planned, replicated state, an optimizer that steps one
        layer alone. The stage then agrees the attention windows every step (the decision's gaps)."""
        return self.planned and not self.partitioned and self.optimizer_steps_one_layer

    def decide_split(self, device, *, attention_s: list, schedule_costs) -> bool:
        """Whether the next step's EDP sync of replicated experts is split around the step
        (expert_dp.py): :func:`split_sync_pays` on :meth:`split_inputs`, ``lead`` 1 (a layer's rows
        are first used by its replica gather, during the layer before), on every rank of the EDP
        group (the members must issue the same collectives: the minimum). False without a plan
        or an input, for partitioned state, or an expert optimizer that cannot step one layer
        alone (``STEPS_ONE_LAYER``)."""
        if not self.may_split:
            return False
        inputs = self.split_inputs(attention_s=attention_s, schedule_costs=schedule_costs)
        pays = inputs is not None and split_sync_pays(*inputs, lead=1)
        agreed = torch.tensor([1.0 if pays else 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.edp_group)
        return bool(agreed.item())

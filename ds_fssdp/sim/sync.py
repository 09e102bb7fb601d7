"""The iteration's gradient and parameter sync in the simulators, by ZeRO stage.

Legend: L MoE layers, D ranks of the world, N ranks of a group, K all-reduce groups.

Two syncs are issued together (:func:`~ds_fssdp.sim.links.allreduce_links`: rings over the world's
links): the dense gradients over the world and, with several groups, each EDP group's owned expert
gradients (the ranks at one position in every group).

* ZeRO 0 (``Setup.zero_stage`` 0): both are all-reduced before the optimizer step (the runtime's
  ``ReplicatedExperts``, DeepSpeed's stage 0): ``reduce_s`` is the whole ring. Under FSSDP with
  the gaps the experts' part may be split instead (``split_experts``; the cluster engine takes
  the runtime's decision, :func:`~ds_fssdp.planner.schedule.split_sync_pays` on the last step's
  gaps, the runtime's inputs: :func:`split_inputs`): its reduce-scatter before the step, its
  all-gather of the summed gradients in the next forward (``forward_gather_s``), each layer's
  update where they land.
* ZeRO 1: a ring all-reduce is a reduce-scatter and an all-gather of the same bytes, so
  ``reduce_s`` is the reduce-scatter (half), which must land before the step (the optimizer
  steps slices, its global norm needs every gradient); the dense parameters' all-gather runs at
  the step, exposed, as DeepSpeed's ZeRO 1/2 run it (``step_gather_s``); the EDP experts' all-gather
  (``forward_gather_s``) is the runtime's ``PartitionedExperts.publish``: under a schedule with
  gradients in the gaps each layer's gather runs during the next forward and is waited for only
  where that layer first uses its rows; otherwise at the step, exposed.

:func:`exposed_sync` charges a policy's schedule: with the gaps, the reduce drains in the
backward's link gaps after each layer's backward and the experts' gather in the next forward's gaps
before each layer's deadline (:func:`~ds_fssdp.planner.schedule.split_sync_exposed`, what the
runtime's split decision compares too); without, the reduce hides under the
backward of every layer but the last to run (layer 0's) and both gathers are exposed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_fssdp.planner.schedule import split_sync_exposed, split_sync_inputs
from ds_fssdp.sim.links import Links, allreduce_links
from ds_fssdp.sim.setup import GRAD_BYTES, Setup


@dataclass(frozen=True)
class SyncTimes:
    reduce_s: float  # lands before the optimizer step: issued per layer after its backward
    step_gather_s: float  # all-gathered at the step, exposed (ZeRO 1: the dense parameters)
    forward_gather_s: float  # the EDP experts' all-gather after the step, per layer before its next use
    links: Links  # bytes over every link, the whole sync (the all-reduce's at ZeRO 0)


def sync_times(setup: Setup, group_size: int, owned_N: np.ndarray | None = None, *,
               split_experts: bool = False) -> SyncTimes:
    """The sync of groups of ``group_size`` ranks, rank i of a group owning ``owned_N[i]`` experts
    over all layers (None: E L / N each, the even owners the bound assumes). ``split_experts``
    (ZeRO 0): the EDP experts' all-reduce runs as its reduce-scatter before the step and its
    all-gather (of the summed gradients, each layer updated where it lands) in the next forward,
    as ZeRO 1's (the dense part stays DeepSpeed's all-reduce)."""
    D, N, G = setup.topology.num_ranks, group_size, setup.topology.ranks_per_node
    dense_M = np.ones((1, D), dtype=bool)
    dense_K = np.array([float(setup.dense_params * GRAD_BYTES)])
    edp_M = np.zeros((0, D), dtype=bool)
    edp_K = np.zeros(0)
    if D // N > 1:
        if owned_N is None:
            owned_N = np.full(N, setup.num_experts * setup.num_layers / N)
        edp_M = np.tile(np.eye(N, dtype=bool), (1, D // N))
        edp_K = np.asarray(owned_N, dtype=np.float64) * setup.shape.params * GRAD_BYTES

    def seconds(members, sizes) -> float:
        links = allreduce_links(members, np.asarray(sizes, dtype=np.float64), ranks_per_node=G)
        return float(links.time_B(setup.hw)[0]) if members.shape[0] else 0.0

    whole = allreduce_links(np.concatenate([dense_M, edp_M]), np.concatenate([dense_K, edp_K]), ranks_per_node=G)
    if setup.zero_stage == 0 and not (split_experts and edp_K.size):
        return SyncTimes(float(whole.time_B(setup.hw)[0]), 0.0, 0.0, whole)
    # A ring reduce-scatter (all-gather) is half a ring all-reduce's bytes.
    experts = seconds(edp_M, edp_K / 2.0)
    if setup.zero_stage == 0:  # the dense all-reduce and the experts' reduce-scatter, issued together
        reduce = seconds(np.concatenate([dense_M, edp_M]), np.concatenate([dense_K, edp_K / 2.0]))
        return SyncTimes(reduce, 0.0, experts, whole)
    reduce = seconds(np.concatenate([dense_M, edp_M]), np.concatenate([dense_K, edp_K]) / 2.0)
    return SyncTimes(reduce, seconds(dense_M, dense_K / 2.0), experts, whole)


def exposed_sync(sync: SyncTimes, *, gaps: bool, backward_gaps_L, forward_gaps_L, backward_L, lead: int) -> float:
    """Seconds of ``sync`` a step waits for. Per layer in model order: ``backward_gaps_L`` the link
    gaps its backward leaves, ``forward_gaps_L`` its forward's, ``backward_L`` its backward's
    length; ``lead``: how many layers before its own a layer's rows are first used in the forward
    (1 where its replicas are gathered during the layer before; 0 where its own compute is the
    first use). ``gaps`` False: the serial accounting (reduce under the backward, gathers at the step)."""
    L = len(backward_L)
    if not gaps:
        hidden = sum(backward_L) - backward_L[0]  # layer 0's backward runs last
        return max(0.0, sync.reduce_s - hidden) + sync.step_gather_s + sync.forward_gather_s
    return sync.step_gather_s + split_sync_exposed([sync.reduce_s / L] * L, [sync.forward_gather_s / L] * L,
                                                   backward_gaps_L, forward_gaps_L, lead=lead)


MASTER_GRAD_BYTES = 4  # the runtime's experts reduce their fp32 master gradients (runtime/expert_dp.py)


def split_inputs(setup: Setup, group_size: int, owner_LE: np.ndarray, backward_gaps_L, forward_gaps_L,
                 memo: dict | None = None) -> tuple:
    """:func:`~ds_fssdp.planner.schedule.split_sync_inputs` for groups of ``group_size`` ranks with
    owners ``owner_LE``: layer i's gradient is what the rank owning most of its experts reduces (fp32,
    as the runtime), over the EDP rings (all-reduce; reduce-scatter: half its bytes); the gaps the
    step's layers left (at the degrees they ran at). ``memo``: seconds per byte count, reused."""
    D, N, G = setup.topology.num_ranks, group_size, setup.topology.ranks_per_node
    edp_M = np.tile(np.eye(N, dtype=bool), (1, D // N))
    memo = {} if memo is None else memo

    def ring(nbytes: float) -> float:
        if nbytes not in memo:
            links = allreduce_links(edp_M, np.full(N, float(nbytes)), ranks_per_node=G)
            memo[nbytes] = float(links.time_B(setup.hw)[0])
        return memo[nbytes]

    elems_L = [int(np.bincount(np.asarray(o).ravel(), minlength=N).max()) * setup.shape.params for o in owner_LE]
    return split_sync_inputs(elems_L, MASTER_GRAD_BYTES, backward_gaps_L, forward_gaps_L,
                             allreduce=ring, reduce_scatter=lambda b: ring(b / 2.0))

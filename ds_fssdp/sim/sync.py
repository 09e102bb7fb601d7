"""The optimizer step's gradient and parameter sync in the simulators, by ZeRO stage: DeepSpeed's
dense part and the experts' part, each charged as the runtime moves it.

Legend: L MoE layers, D ranks of the world, N ranks of a group.

* Dense (:func:`dense_sync`): DeepSpeed's own (``runtime/engine.py`` calls its backward and step
  unchanged). At ZeRO 0 its engine all-reduces the dense gradients after the accumulation
  boundary's backward (``allreduce_gradients`` -> ``buffered_allreduce_fallback``, in its
  communication dtype: ``Setup.grad_sync_bytes``, bf16 by default); at ZeRO 1 (``overlap_comm`` off, its default below ZeRO
  3) it reduces them into the partitions after that backward and all-gathers the stepped
  parameters at the step. None of it overlaps the backward (ZeRO 2's hooks would: not modelled).
* Experts (:func:`expert_inputs`): the runtime's (``runtime/expert_dp.py``), per layer, from
  :func:`~ds_fssdp.planner.schedule.split_sync_inputs`, the inputs the runtime decides its split
  with: each layer's gradient of its busiest owner over the EDP rings (the ranks at one position in
  every group) in DeepSpeed's communication dtype (``Setup.grad_sync_bytes``, from
  ``planner/sync_dtype.py`` as the runtime's dtype: bf16 by default, as EP's), the gaps its layers'
  schedule left at the degrees they ran at. A step
  all-reduces it (ZeRO 0), or reduce-scatters it and all-gathers (a split ZeRO 0 step: the summed
  gradient; ZeRO 1: the stepped rows in their dtype, PARAM_BYTES).

:func:`exposed_sync` charges a step: with the gaps (``grads_in_gaps``: FSSDP, fsmoe) each layer's
reduce is issued after its backward and drains in the gaps below, its all-gather in the next
forward before the layer's first use (:func:`~ds_fssdp.planner.schedule.split_sync_exposed`);
without (``--no-grad-gaps``) all of it at the step. What the experts leave after the backward shares
the links with DeepSpeed's dense collectives, which run then: the two add. EP and Uniform are
DeepSpeed's MoE: its engine reduces their experts' gradients as the dense ones, after the backward,
bucketed over all layers, in the same communication dtype. :func:`sync_times`: a whole step's parts at given owners, one
collective per ring, and every link's bytes (the lower bound, the links, DeepSpeed's MoE).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_fssdp.planner.prices import allreduce_share, reduce_scatter_share
from ds_fssdp.planner.schedule import split_sync_exposed, split_sync_inputs
from ds_fssdp.sim.links import Links, allreduce_links
from ds_fssdp.sim.setup import PARAM_BYTES, Setup


@dataclass(frozen=True)
class SyncTimes:
    reduce_s: float  # the experts' reduce (all-reduce; reduce-scatter when split), per layer after its backward
    step_gather_s: float  # DeepSpeed's dense collectives, exposed: after the backward and at the step
    forward_gather_s: float  # the experts' all-gather after the step (split or ZeRO 1), per layer before its next use
    links: Links  # bytes over every link, the whole sync


def _members(setup: Setup, group_size: int) -> np.ndarray:
    """The EDP rings: rank i of every group (one ring per position)."""
    D, N = setup.topology.num_ranks, group_size
    return np.tile(np.eye(N, dtype=bool), (1, D // N))


def _ring(setup: Setup, members: np.ndarray, bytes_K, share) -> Links:
    return allreduce_links(members, np.asarray(bytes_K, dtype=np.float64),
                           ranks_per_node=setup.topology.ranks_per_node, share=share)


def _seconds(setup: Setup, links: Links) -> float:
    return float(links.time_B(setup.hw)[0])


def _dense_links(setup: Setup) -> list:
    """DeepSpeed's dense collectives, in order: ZeRO 0 the all-reduce after the backward; ZeRO 1 the
    reduce-scatter after it and the parameters' all-gather at the step."""
    world = np.ones((1, setup.topology.num_ranks), dtype=bool)
    grads = [float(setup.dense_params * setup.grad_sync_bytes)]
    if setup.zero_stage == 0:
        return [_ring(setup, world, grads, allreduce_share)]
    return [_ring(setup, world, grads, reduce_scatter_share),
            _ring(setup, world, [float(setup.dense_params * PARAM_BYTES)], reduce_scatter_share)]


def dense_sync(setup: Setup) -> float:
    """Seconds of DeepSpeed's dense collectives a step waits for, all exposed (module docstring)."""
    return sum(_seconds(setup, links) for links in _dense_links(setup))


def expert_inputs(setup: Setup, group_size: int, owner_LE: np.ndarray, backward_gaps_L, forward_gaps_L,
                  memo: dict | None = None) -> tuple | None:
    """:func:`~ds_fssdp.planner.schedule.split_sync_inputs` for groups of ``group_size`` ranks with
    owners ``owner_LE``: layer i's gradient is what the rank owning most of its experts reduces (in
    ``setup.grad_sync_bytes`` per element, as the runtime), over the EDP rings (:func:`~ds_fssdp.planner.prices.allreduce_share`, and
    :func:`~ds_fssdp.planner.prices.reduce_scatter_share` for a reduce-scatter or an all-gather);
    the gaps the step's layers left. None with one group (no EDP sync). ``memo``: seconds per
    (bytes, collective), reused."""
    D, N = setup.topology.num_ranks, group_size
    if D // N <= 1:
        return None
    members = _members(setup, N)
    memo = {} if memo is None else memo

    def ring(nbytes: float, share) -> float:
        key = (nbytes, share is allreduce_share)
        if key not in memo:
            memo[key] = _seconds(setup, _ring(setup, members, np.full(N, float(nbytes)), share))
        return memo[key]

    elems_L = [int(np.bincount(np.asarray(o).ravel(), minlength=N).max()) * setup.shape.params for o in owner_LE]
    return split_sync_inputs(elems_L, setup.grad_sync_bytes, backward_gaps_L, forward_gaps_L,
                             allreduce=lambda b: ring(b, allreduce_share),
                             reduce_scatter=lambda b: ring(b, reduce_scatter_share),
                             gather_bytes=PARAM_BYTES if setup.zero_stage else None)


def exposed_sync(dense_s: float, experts: tuple | None, *, gaps: bool, split: bool, lead: int) -> float:
    """Seconds of a step's sync it waits for: DeepSpeed's ``dense_s`` (:func:`dense_sync`) and the
    experts' (``experts``: :func:`expert_inputs`, None: none). ``split``: the experts' sync runs as
    its reduce-scatter and all-gather (a split ZeRO 0 step, or ZeRO 1). ``lead``: how many layers
    before its own a layer's rows are first used in the forward (1 where its replicas are gathered
    during the layer before; 0 where its own compute is the first use). ``gaps`` False: the experts'
    collectives at the step, one layer after another."""
    if experts is None:
        return dense_s
    allreduce_L, reduce_L, gather_L, backward_gaps_L, forward_gaps_L = experts
    work_L, gather_L = (reduce_L, gather_L) if split else (allreduce_L, [0.0] * len(allreduce_L))
    if not gaps:
        return dense_s + sum(work_L) + sum(gather_L)
    return dense_s + split_sync_exposed(work_L, gather_L, backward_gaps_L, forward_gaps_L, lead=lead)


def sync_times(setup: Setup, group_size: int, owned_N: np.ndarray | None = None, *,
               split_experts: bool = False) -> SyncTimes:
    """A step's sync with groups of ``group_size`` ranks, rank i of a group owning ``owned_N[i]``
    experts over all layers (None: E L / N each, the even owners the bound assumes), the experts'
    part as one collective of all layers' bytes per ring (its least: one latency; DeepSpeed's EP
    buckets them so), in the communication dtype (``setup.grad_sync_bytes``: the runtime's and
    DeepSpeed's MoE's alike). ``split_experts``
    (ZeRO 0): the experts' all-reduce runs as a reduce-scatter and an all-gather (ZeRO 1's always do)."""
    D, N = setup.topology.num_ranks, group_size
    grad_bytes = setup.grad_sync_bytes
    parts = _dense_links(setup)
    reduce_s = gather_s = 0.0
    if D // N > 1:
        if owned_N is None:
            owned_N = np.full(N, setup.num_experts * setup.num_layers / N)
        members, elems_N = _members(setup, N), np.asarray(owned_N, dtype=np.float64) * setup.shape.params
        split = split_experts or setup.zero_stage >= 1
        reduce = _ring(setup, members, elems_N * grad_bytes, reduce_scatter_share if split else allreduce_share)
        reduce_s = _seconds(setup, reduce)
        parts.append(reduce)
        if split:
            gather = _ring(setup, members, elems_N * (PARAM_BYTES if setup.zero_stage else grad_bytes),
                           reduce_scatter_share)
            gather_s = _seconds(setup, gather)
            parts.append(gather)
    links = Links(rank_BN=sum(p.rank_BN for p in parts), node_Bn=sum(p.node_Bn for p in parts))
    return SyncTimes(reduce_s, dense_sync(setup), gather_s, links)

"""Model-state memory per rank, and the FSSDP budget m that keeps it within a multiple of EP's.

Legend: E experts, L MoE layers, N ranks of a group.

Bytes per parameter as :mod:`.setup` (2 parameters, 2 gradients, 12 optimizer state; replicas
carry parameters and gradients only). Every rank holds the dense part; a rank of a group of N
holds the experts it owns (under EP, the homogeneous shard: ceil(E / N) per layer on the fullest
rank; with N > E one expert on E of the ranks, as an EP group of E would). FSSDP owns the same
and adds at most m replicas per layer (Algorithm 1 and calibration never exceed the budget),
alive for all L layers, or for two with re-materialization (fssdp-rm). Under ZeRO 1
(``Setup.zero_stage``) every policy keeps the optimizer state of its slices only
(:func:`optimizer_params`: DeepSpeed partitions the dense part over the world and an MoE model's
expert part over the expert-data-parallel group; the runtime's ``PartitionedExperts`` the same).
"""
from __future__ import annotations

import numpy as np

from ds_fssdp.planner.knobs import resident_layers
from ds_fssdp.planner.prices import replica_bytes
from ds_fssdp.planner.shard import homogeneous_owner
from ds_fssdp.sim.setup import GRAD_BYTES, OPT_BYTES, PARAM_BYTES, Setup

STATE_BYTES = PARAM_BYTES + GRAD_BYTES  # a held parameter and its gradient (the optimizer's apart)


def owned_per_layer(num_experts: int, group_size: int) -> int:
    """Experts the fullest rank of a group owns per layer (homogeneous sharding)."""
    return int(homogeneous_owner(num_experts, group_size).bincount(minlength=group_size).max())


def optimizer_params(setup: Setup, owned, group_size: int):
    """Parameters whose optimizer state a rank of a group of ``group_size`` keeps, owning ``owned``
    expert parameters (a number or an array): all of them under ZeRO 0; under ZeRO 1 its slices, the
    dense part over the world's D ranks and the owned experts over the D / N groups' ranks at its
    position (one group: not partitioned)."""
    if setup.zero_stage == 0:
        return setup.dense_params + owned
    D = setup.topology.num_ranks
    return setup.dense_params / D + owned / max(1, D // group_size)


def peak_state(setup: Setup, owned, ephemeral_LN, *, rm: bool, group_size: int, reserved: float = 0.0) -> tuple:
    """``(bytes, {"param", "grad", "opt"})`` of the fullest rank: each rank owning ``owned`` expert
    parameters (``[N]``), holding ``ephemeral_LN`` replicas per layer (leading axes: groups) alive
    all layers, or the largest two consecutive layers' under re-materialization (``rm``), and
    ``reserved`` parameters of slots with full state (FlexMoE's)."""
    P, e, owned = setup.shape.params, np.asarray(ephemeral_LN, dtype=np.float64), np.asarray(owned, dtype=np.float64)
    if rm:
        replica = (e[..., :-1, :] + e[..., 1:, :]).max(-2) * P if e.shape[-2] > 1 else e[..., 0, :] * P
    else:
        replica = e.sum(-2) * P
    stateful = setup.dense_params + owned + reserved
    param, grad = PARAM_BYTES * (stateful + replica), GRAD_BYTES * (stateful + replica)
    opt = np.broadcast_to(OPT_BYTES * (optimizer_params(setup, owned, group_size) + reserved), param.shape)
    total = param + grad + opt
    i = np.unravel_index(int(np.argmax(total)), total.shape)
    return float(total[i]), {"param": float(param[i]), "grad": float(grad[i]), "opt": float(opt[i])}


def ep_memory_bytes(setup: Setup, group_size: int) -> float:
    """Model states of EP's fullest rank with groups of ``group_size``."""
    owned = owned_per_layer(setup.num_experts, group_size) * setup.num_layers * setup.shape.params
    return float(STATE_BYTES * (setup.dense_params + owned) + OPT_BYTES * optimizer_params(setup, owned, group_size))


def budget_for_cap(setup: Setup, group_size: int, cap: float, *, rematerialize: bool, in_flight: int = 1) -> int:
    """The largest m whose worst case keeps FSSDP's fullest rank within ``cap`` x EP's (at the
    same group size and homogeneous owners: a re-shard may change what the fullest rank owns);
    ``in_flight``: micro-batches holding replicas at once (a pipeline stage's, planner/knobs.py)."""
    if cap < 1.0:
        raise ValueError(f"memory_cap ({cap}) must be >= 1.0: FSSDP owns what EP owns")
    alive = resident_layers(setup.num_layers, rematerialize=rematerialize, in_flight=in_flight)
    per_replica = replica_bytes(setup.shape.expert_bytes) * alive
    return int((cap - 1.0) * ep_memory_bytes(setup, group_size) // per_replica)

"""The C versions of the planner's per-iteration steps (``_fastplan``, built at install).

Legend: E experts, D ranks.

Each function mirrors its Python reference step for step (tests compare them); the public
planner functions call these when the extension is built, and say once, at INFO, when it is not.
"""
from __future__ import annotations

import numpy as np
import torch
from deepspeed.utils import logger

from ds_fssdp.planner.plan import DispatchPlan
from ds_fssdp.topology import Topology

try:
    from ds_fssdp.planner import _fastplan
except ImportError:  # a source tree used without `pip install`
    _fastplan = None
    logger.info("ds_fssdp: the planner's C extension is not built; planning uses the Python reference "
                "(correct, but milliseconds per layer). `pip install -e .` builds it.")

AVAILABLE = _fastplan is not None


def _np(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    if t.dtype != dtype or t.is_cuda:
        t = t.to("cpu", dtype)
    a = t.detach().numpy()
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _shard(owner: np.ndarray, num_ranks: int) -> np.ndarray:
    shard = np.zeros((owner.size, num_ranks), dtype=np.bool_)
    shard[np.arange(owner.size), owner] = True
    return shard


def materialize_alg1(owner_E, load_E, topology: Topology, *, overlap_degree: int, budget: int) -> torch.Tensor:
    owner = _np(owner_E, torch.long)
    D = topology.num_ranks
    placement = _shard(owner, D)
    _fastplan.materialize_alg1(owner, _np(load_E, torch.float64).reshape(-1), topology.node_np, placement,
                               owner.size, D, topology.num_nodes, overlap_degree, budget)
    return torch.from_numpy(placement)


def materialize_joint(owner_E, tokens_ED, topology: Topology, *, overlap_degree: int, budget: int,
                      stop: float) -> torch.Tensor:
    owner = _np(owner_E, torch.long)
    D = topology.num_ranks
    placement = np.zeros((owner.size, D), dtype=np.bool_)
    _fastplan.materialize_joint(owner, _np(tokens_ED, torch.float64), topology.node_np, placement, owner.size, D,
                                topology.num_nodes, overlap_degree, budget, stop)
    return torch.from_numpy(placement)


def _dispatch(fn, placement_ED, tokens_ED, topology: Topology, *extra) -> torch.Tensor:
    E, D = placement_ED.shape
    plan = np.zeros((E, D, D), dtype=np.int64)
    fn(_np(placement_ED, torch.bool), _np(tokens_ED, torch.long), topology.node_np, plan, E, D, *extra)
    return torch.from_numpy(plan)


def dispatch_compact(placement_ED, tokens_ED, topology: Topology, *, balanced: bool, slack: float = 0.0):
    """The plan as :class:`~ds_fssdp.planner.plan.DispatchPlan` (no dense [E, D, D] tensor)."""
    P = _np(placement_ED, torch.bool)
    T = _np(tokens_ED, torch.long)
    E, D = P.shape
    holder, rep, flows = _fastplan.dispatch_compact(P, T, topology.node_np, E, D, float(slack), balanced)
    rep_X = np.frombuffer(rep, dtype=np.int64)
    return DispatchPlan(tokens_ED=T, holder_E=np.frombuffer(holder, dtype=np.int64), rep_X=rep_X,
                        flows_XHD=np.frombuffer(flows, dtype=np.int64).reshape(rep_X.size, D, D))


def dispatch_paper(placement_ED, tokens_ED, topology: Topology) -> torch.Tensor:
    return _dispatch(_fastplan.dispatch_paper, placement_ED, tokens_ED, topology)


def dispatch_balanced(placement_ED, tokens_ED, topology: Topology, slack: float = 0.0) -> torch.Tensor:
    return _dispatch(_fastplan.dispatch_balanced, placement_ED, tokens_ED, topology, float(slack))

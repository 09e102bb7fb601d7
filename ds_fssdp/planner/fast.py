"""The C versions of the planner's per-iteration steps (``_fastplan``, built at install).

Legend: E experts, D ranks, X replicated experts.

Each function mirrors its Python reference step for step (tests compare them); the public
planner functions call these when the extension is built, and say once, at INFO, when it is not.

Planning runs for every MoE layer every iteration, so the glue is kept thin: inputs go to C as
addresses of C-contiguous CPU tensors of the right dtype (converted only when they are not, and
kept alive by this frame for the call); the callers check shapes, C checks the values that
could index out of bounds (owner ids, negative counts) and raises ValueError.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ds_fssdp.planner.plan import DispatchPlan
from ds_fssdp.planner.prices import _fastplan  # the planner's C, None where not built
from ds_fssdp.topology import Topology

if _fastplan is None:  # a source tree used without `pip install`
    logging.getLogger(__name__).info("ds_fssdp: the planner's C extension is not built; planning uses the Python reference "
                "(correct, but milliseconds per layer). `pip install -e .` builds it.")

AVAILABLE = _fastplan is not None


_Tensor, _LONG, _F64, _BOOL = torch.Tensor, torch.long, torch.float64, torch.bool
_I64 = np.dtype(np.int64)


def _c(t, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a C-contiguous CPU tensor of ``dtype`` (itself when it already is one)."""
    if not isinstance(t, _Tensor):
        t = torch.as_tensor(np.asarray(t))
    if t.dtype is not dtype or not t.is_cpu or not t.is_contiguous():
        t = t.to("cpu", dtype).contiguous()
    return t


def materialize_alg1(owner_E, load_E, topology: Topology, overlap_degree: int, budget: int,
                     base_ED=None) -> torch.Tensor:
    """``base_ED``: the placement to extend (calibration), None for the shard."""
    owner, load = _c(owner_E, _LONG), _c(load_E, _F64)
    E, D = owner.numel(), topology.num_ranks
    base = None if base_ED is None else _c(base_ED, _BOOL)
    if base is not None and base.shape != (E, D):
        raise ValueError(f"base_ED {tuple(base.shape)} does not match {E} experts on {D} ranks")
    placement = np.empty((E, D), dtype=np.bool_)  # zeroed in C
    _fastplan.materialize_alg1(owner.data_ptr(), load.data_ptr(), placement, E, D, topology.ranks_per_node,
                               overlap_degree, budget, 0 if base is None else base.data_ptr())
    return torch.from_numpy(placement)


def materialize_joint(owner_E, tokens_ED, topology: Topology, overlap_degree: int, budget: int,
                      stop: float) -> torch.Tensor:
    """(Arguments by position: this runs for every layer, every iteration.)"""
    owner, tokens = _c(owner_E, _LONG), _c(tokens_ED, _F64)
    E, D = owner.numel(), topology.num_ranks
    if tokens.shape != (E, D):
        raise ValueError(f"tokens_ED {tuple(tokens.shape)} does not match {E} experts on {D} ranks")
    placement = np.empty((E, D), dtype=np.bool_)  # zeroed in C
    _fastplan.materialize_joint(owner.data_ptr(), tokens.data_ptr(), placement, E, D, topology.ranks_per_node,
                                overlap_degree, budget, stop)
    return torch.from_numpy(placement)


def _dispatch_inputs(placement_ED, tokens_ED, topology: Topology, slack: float):
    """(P, T, E, D): the dispatch inputs as C-contiguous CPU tensors, shapes, ranks and slack checked."""
    P, T = _c(placement_ED, _BOOL), _c(tokens_ED, _LONG)
    shape = P.shape
    if T.shape != shape or shape[1] != topology.num_ranks or slack < 0:
        raise ValueError(f"tokens_ED {tuple(T.shape)} must match placement_ED {tuple(shape)} on "
                         f"{topology.num_ranks} ranks, and slack ({slack}) must be >= 0")
    return P, T, shape[0], shape[1]


def dispatch_compact(placement_ED, tokens_ED, topology: Topology, balanced: bool, slack: float) -> DispatchPlan:
    """The plan as :class:`~ds_fssdp.planner.plan.DispatchPlan` (no dense [E, D, D] tensor)."""
    P, T, E, D = _dispatch_inputs(placement_ED, tokens_ED, topology, slack)
    X, F, buf = _fastplan.dispatch_compact(P.data_ptr(), T.data_ptr(), E, D, topology.ranks_per_node, slack, balanced)
    out = np.frombuffer(buf, _I64)
    a, b = E + X, E + X + E * D
    return DispatchPlan(out[a:b].reshape(E, D), out[:E], out[E:a], out[b:].reshape(4, F))  # tokens, holder, rep, flows


def _dense(placement_ED, tokens_ED, topology: Topology, *, balanced: bool, slack: float = 0.0) -> torch.Tensor:
    P, T, E, D = _dispatch_inputs(placement_ED, tokens_ED, topology, slack)
    plan = np.zeros((E, D, D), dtype=np.int64)
    _fastplan.dispatch_dense(P.data_ptr(), T.data_ptr(), plan, E, D, topology.ranks_per_node, float(slack), balanced)
    return torch.from_numpy(plan)


def dispatch_paper(placement_ED, tokens_ED, topology: Topology) -> torch.Tensor:
    return _dense(placement_ED, tokens_ED, topology, balanced=False)


def dispatch_balanced(placement_ED, tokens_ED, topology: Topology, slack: float = 0.0) -> torch.Tensor:
    return _dense(placement_ED, tokens_ED, topology, balanced=True, slack=slack)

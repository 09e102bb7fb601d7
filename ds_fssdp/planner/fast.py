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


def _c(t, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a C-contiguous CPU tensor of ``dtype`` (itself when it already is one)."""
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(np.asarray(t))
    if t.dtype is not dtype or not t.is_cpu or not t.is_contiguous():
        t = t.to("cpu", dtype).contiguous()
    return t


def materialize_alg1(owner_E, load_E, topology: Topology, *, overlap_degree: int, budget: int) -> torch.Tensor:
    owner, load = _c(owner_E, torch.long), _c(load_E, torch.float64)
    E = owner.numel()
    placement = np.empty((E, topology.num_ranks), dtype=np.bool_)  # zeroed in C
    _fastplan.materialize_alg1(owner.data_ptr(), load.data_ptr(), placement, E, topology.num_ranks,
                               topology.ranks_per_node, overlap_degree, budget)
    return torch.from_numpy(placement)


def materialize_joint(owner_E, tokens_ED, topology: Topology, *, overlap_degree: int, budget: int,
                      stop: float) -> torch.Tensor:
    owner, tokens = _c(owner_E, torch.long), _c(tokens_ED, torch.float64)
    E, D = owner.numel(), topology.num_ranks
    if tokens.shape != (E, D):
        raise ValueError(f"tokens_ED {tuple(tokens.shape)} does not match {E} experts on {D} ranks")
    placement = np.empty((E, D), dtype=np.bool_)  # zeroed in C
    _fastplan.materialize_joint(owner.data_ptr(), tokens.data_ptr(), placement, E, D, topology.ranks_per_node,
                                overlap_degree, budget, stop)
    return torch.from_numpy(placement)


_I64 = np.dtype(np.int64)


def _dispatch_inputs(placement_ED, tokens_ED, topology: Topology, slack: float):
    """(P, T, E, D): the dispatch inputs as C-contiguous CPU tensors, shapes, ranks and slack checked."""
    P, T = _c(placement_ED, torch.bool), _c(tokens_ED, torch.long)
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
    a = E + X
    return DispatchPlan(tokens_ED=out[a:a + E * D].reshape(E, D), holder_E=out[:E], rep_X=out[E:a],
                        flows_4F=out[a + E * D:].reshape(4, F))


def _dense(placement_ED, tokens_ED, topology: Topology, *, balanced: bool, slack: float = 0.0) -> torch.Tensor:
    P, T, E, D = _dispatch_inputs(placement_ED, tokens_ED, topology, slack)
    plan = np.zeros((E, D, D), dtype=np.int64)
    _fastplan.dispatch_dense(P.data_ptr(), T.data_ptr(), plan, E, D, topology.ranks_per_node, float(slack), balanced)
    return torch.from_numpy(plan)


def dispatch_paper(placement_ED, tokens_ED, topology: Topology) -> torch.Tensor:
    return _dense(placement_ED, tokens_ED, topology, balanced=False)


def dispatch_balanced(placement_ED, tokens_ED, topology: Topology, slack: float = 0.0) -> torch.Tensor:
    return _dense(placement_ED, tokens_ED, topology, balanced=True, slack=slack)

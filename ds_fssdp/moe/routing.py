"""Local index math for one MoE dispatch (no communication): from this rank's routing and the
global dispatch plan to the orders of the rows it sends, receives and computes.

Legend: T tokens, K top-k, A = T * K assignments, E experts, D ranks, S local compute slots.

Send order: destination rank, then expert, then token order. Receive order: source rank, then
expert. Compute order: local slot (an expert held here), then source rank. Every rank derives the
same plan, so a sender's order and the receiver's agree without exchanging indices.
"""
from __future__ import annotations

import numpy as np
import torch

from ds_fssdp.planner.plan import DispatchPlan

try:
    from ds_fssdp.moe import _fastroute
except ImportError:  # a source tree used without `pip install`: route_reference (slower, same result)
    _fastroute = None


class Route:
    """A rank's orders for one dispatch. ``unsend``, ``group_perm`` and ``ungroup_perm`` are only
    needed once the token exchange is under way: the C route leaves them to ``finish``,
    computed on first use (after the all-to-all is launched, off the critical path)."""

    __slots__ = ("send_token", "send_splits", "recv_splits", "group_sizes", "_rest", "_finish")

    def __init__(self, *, send_token: torch.Tensor, send_splits: list, recv_splits: list, group_sizes: list,
                 unsend: torch.Tensor | None = None, group_perm: torch.Tensor | None = None,
                 ungroup_perm: torch.Tensor | None = None, finish=None):
        self.send_token = send_token  # long [n_send]: token of each sent row
        self.send_splits = send_splits  # [D]
        self.recv_splits = recv_splits  # [D]
        self.group_sizes = group_sizes  # [S] rows per local slot
        self._rest = None if finish is not None else (unsend, group_perm, ungroup_perm)
        self._finish = finish  # () -> (unsend, group_perm, ungroup_perm)

    def _orders(self) -> tuple:
        if self._rest is None:
            self._rest, self._finish = self._finish(), None
        return self._rest

    @property
    def unsend(self) -> torch.Tensor:
        """long [A]: position, in send order, of each assignment t * K + k."""
        return self._orders()[0]

    @property
    def group_perm(self) -> torch.Tensor:
        """long [n_recv]: compute order <- receive order."""
        return self._orders()[1]

    @property
    def ungroup_perm(self) -> torch.Tensor:
        """long [n_recv]: receive order <- compute order."""
        return self._orders()[2]


class ExpertOrder:
    """A rank's assignments grouped by expert (:func:`expert_order`), computed before the count
    all-gather so the route after the plan only cuts the groups."""

    __slots__ = ("order_A", "token_A", "start_E")

    def __init__(self, order_A: np.ndarray, token_A: np.ndarray, start_E: np.ndarray):
        self.order_A, self.token_A, self.start_E = order_A, token_A, start_E  # assignments, their tokens


def expert_order(idx_TK: torch.Tensor, num_experts: int) -> ExpertOrder | None:
    """The stable grouping of ``idx_TK``'s assignments by expert (C), or None where :func:`route`
    does not use it (CUDA routing, no C extension). Raises on an index that is not an expert."""
    if idx_TK.is_cuda or _fastroute is None:
        return None
    e_A = np.ascontiguousarray(idx_TK.to("cpu", torch.long).reshape(-1).numpy())
    order, token = np.empty(e_A.size, dtype=np.int64), np.empty(e_A.size, dtype=np.int64)
    start = np.empty(num_experts + 1, dtype=np.int64)
    if not _fastroute.expert_order(e_A, idx_TK.shape[1], num_experts, order, token, start):
        bad = e_A[(e_A < 0) | (e_A >= num_experts)]
        raise RuntimeError(f"routed expert indices {bad[:8].tolist()} are not in [0, {num_experts})")
    return ExpertOrder(order, token, start)


def route(idx_TK: torch.Tensor, plan_EDD, *, rank: int, local_E: torch.Tensor,
          grouped: ExpertOrder | None = None) -> Route:
    """``plan_EDD``: the dense plan, or a :class:`~ds_fssdp.planner.plan.DispatchPlan`.

    Linear time in C (``_fastroute``), split around the token all-to-all's launch: ``grouped``
    (:func:`expert_order`, taken before the plan, or here) is cut into the send order, the one
    thing the exchange waits for, and the unsend and compute orders are left to the
    :class:`Route`'s first use of them. :func:`route_reference` sorts keys: same result, the
    fallback when the extension is not built. CUDA routing goes to :func:`route_device` (the index
    math stays on the device)."""
    if idx_TK.is_cuda:
        return route_device(idx_TK, plan_EDD, rank=rank, local_E=local_E)
    if _fastroute is None:
        return route_reference(idx_TK, plan_EDD, rank=rank, local_E=local_E)
    fr = _fastroute
    E, D, _ = plan_EDD.shape
    if grouped is None:
        grouped = expert_order(idx_TK, E)
    if isinstance(plan_EDD, DispatchPlan):
        mine_ED, recv_DE = np.empty((E, D), dtype=np.int64), np.empty((D, E), dtype=np.int64)
        fr.plan_tables(_i64(plan_EDD.holder_E), _i64(plan_EDD.rep_X), _i64(plan_EDD.tokens_ED),
                       _i64(plan_EDD.flows_4F), rank, E, D, mine_ED, recv_DE)
    else:
        mine_ED = np.ascontiguousarray(plan_EDD[:, rank, :].to(torch.long).numpy())
        recv_DE = np.ascontiguousarray(plan_EDD[:, :, rank].to(torch.long).numpy().T)
    local_S = np.ascontiguousarray(local_E.to("cpu", torch.long).numpy())
    if not fr.check_local(local_S, recv_DE, E, D):
        held = np.zeros(E, dtype=bool)
        held[local_S] = True
        raise RuntimeError(f"rank {rank} is sent tokens for experts it does not hold: "
                           f"{np.flatnonzero(~held & (recv_DE.sum(0) > 0)).tolist()}")
    A = grouped.order_A.size
    send_token = np.empty(A, dtype=np.int64)
    if not fr.send_order(grouped.order_A, grouped.token_A, grouped.start_E, mine_ED, E, D, send_token):
        raise RuntimeError(f"rank {rank}: routed counts {np.diff(grouped.start_E).tolist()} disagree with the "
                           f"dispatch plan {mine_ED.sum(1).tolist()}")
    recv_D = recv_DE.sum(1)

    def finish():  # the exchange is under way: its return's orders
        R = int(recv_D.sum())
        unsend, group_perm, ungroup_perm = np.empty(A, np.int64), np.empty(R, np.int64), np.empty(R, np.int64)
        fr.finish_orders(grouped.order_A, grouped.start_E, mine_ED, recv_DE, local_S, E, D, unsend, group_perm,
                         ungroup_perm)
        return torch.from_numpy(unsend), torch.from_numpy(group_perm), torch.from_numpy(ungroup_perm)

    return Route(send_token=torch.from_numpy(send_token), send_splits=mine_ED.sum(0).tolist(),
                 recv_splits=recv_D.tolist(), group_sizes=recv_DE[:, local_S].sum(0).tolist(), finish=finish)


def _i64(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) and a.dtype == np.int64 and a.flags.c_contiguous else \
        np.ascontiguousarray(a, dtype=np.int64)


def route_reference(idx_TK: torch.Tensor, plan_EDD, *, rank: int, local_E: torch.Tensor) -> Route:
    """:func:`route` by sorting keys: the specification it is tested against."""
    return _route_by_sorting(idx_TK.to("cpu", torch.long), plan_EDD, rank=rank, local_E=local_E, check=True)


def route_device(idx_TK: torch.Tensor, plan_EDD, *, rank: int, local_E: torch.Tensor) -> Route:
    """:func:`route_reference`'s key sorts as torch ops on ``idx_TK``'s device (a GPU's routing
    never visits the host): the plan's two [E, D] tables of this rank go to the device in one copy
    each, the splits and group sizes come from the host plan (no device-to-host sync). The checks
    of :func:`route` (counts against the plan, experts held) are left out: they would sync; the
    plan was built from these counts. Same result as :func:`route` (tested on CPU tensors)."""
    return _route_by_sorting(idx_TK.long(), plan_EDD, rank=rank, local_E=local_E, check=False)


def _route_by_sorting(idx_TK: torch.Tensor, plan_EDD, *, rank: int, local_E: torch.Tensor, check: bool) -> Route:
    dev = idx_TK.device
    num_experts, num_ranks, _ = plan_EDD.shape
    K = idx_TK.shape[1]
    e_A = idx_TK.reshape(-1)
    dense = isinstance(plan_EDD, torch.Tensor)
    mine_ED = (plan_EDD[:, rank, :] if dense else plan_EDD.sent(rank)).to("cpu", torch.long)
    recv_DE = (plan_EDD[:, :, rank] if dense else plan_EDD.received(rank)).to("cpu", torch.long).t()
    local_E = local_E.to("cpu", torch.long)
    slot_E = torch.full((num_experts,), -1, dtype=torch.long)
    slot_E[local_E] = torch.arange(local_E.numel())
    held = slot_E >= 0
    if check:
        counts_E = torch.bincount(e_A, minlength=num_experts)
        if not torch.equal(counts_E, mine_ED.sum(1)):
            raise RuntimeError(f"rank {rank}: routed counts {counts_E.tolist()} disagree with the dispatch plan "
                               f"{mine_ED.sum(1).tolist()}")
        if bool(recv_DE[:, ~held].any()):
            missing = torch.nonzero(recv_DE[:, ~held].sum(0)).flatten()
            raise RuntimeError(f"rank {rank} is sent tokens for experts it does not hold: "
                               f"{torch.arange(num_experts)[~held][missing].tolist()}")
    # Host: the splits, sizes and the receive keys (from the plan alone); device: the per-token math.
    key_DE = slot_E.unsqueeze(0) * num_ranks + torch.arange(num_ranks).unsqueeze(1)
    row_key = torch.repeat_interleave(key_DE.reshape(-1), recv_DE.reshape(-1)).to(dev)
    mine_dev_ED = mine_ED.to(dev)

    # Sort assignments by expert (stable: token order inside an expert), then cut each expert's
    # block into consecutive runs per destination, in destination order.
    by_expert = torch.sort(e_A, stable=True).indices
    e_sorted = e_A[by_expert]
    counts_E = mine_dev_ED.sum(1)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    pos = torch.arange(e_A.numel(), device=dev) - start_E[e_sorted]
    cum_ED = torch.cumsum(mine_dev_ED, 1)
    dest = torch.searchsorted(cum_ED[e_sorted], pos.unsqueeze(1), right=True).squeeze(1)
    send_perm = torch.sort(dest * num_experts + e_sorted, stable=True).indices
    send_assign = by_expert[send_perm]
    unsend = torch.empty_like(send_assign)
    unsend[send_assign] = torch.arange(send_assign.numel(), device=dev)
    group_perm = torch.sort(row_key, stable=True).indices
    ungroup_perm = torch.empty_like(group_perm)
    ungroup_perm[group_perm] = torch.arange(group_perm.numel(), device=dev)
    return Route(send_token=send_assign // K, send_splits=mine_ED.sum(0).tolist(), unsend=unsend,
                 recv_splits=recv_DE.sum(1).tolist(), group_perm=group_perm, ungroup_perm=ungroup_perm,
                 group_sizes=recv_DE.sum(0)[local_E].tolist())

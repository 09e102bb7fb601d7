"""Local index math for one MoE dispatch (no communication): from this rank's routing and the
global dispatch plan to the orders of the rows it sends, receives and computes.

Legend: T tokens, K top-k, A = T * K assignments, E experts, D ranks, S local compute slots.

Send order: destination rank, then expert, then token order. Receive order: source rank, then
expert. Compute order: local slot (an expert held here), then source rank. Every rank derives the
same plan, so a sender's order and the receiver's agree without exchanging indices.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

try:
    from ds_fssdp.moe import _fastroute
except ImportError:  # a source tree used without `pip install`: route_reference (slower, same result)
    _fastroute = None


@dataclass
class Route:
    send_token: torch.Tensor  # long [n_send]: token of each sent row
    send_splits: list  # [D]
    unsend: torch.Tensor  # long [A]: position, in send order, of each assignment t * K + k
    recv_splits: list  # [D]
    group_perm: torch.Tensor  # long [n_recv]: compute order <- receive order
    ungroup_perm: torch.Tensor  # long [n_recv]: receive order <- compute order
    group_sizes: list  # [S] rows per local slot


def route(idx_TK: torch.Tensor, plan_EDD, *, rank: int, local_E: torch.Tensor) -> Route:
    """``plan_EDD``: the dense plan, or a :class:`~ds_fssdp.planner.plan.DispatchPlan`.

    Linear time in C (``_fastroute``: one pass over the assignments places each at the next row
    of its (destination, expert) run; the compute order is ranges of the receive order).
    :func:`route_reference` sorts keys: same result, the fallback when the extension is not
    built. CUDA routing goes to :func:`route_device` (the index math stays on the device)."""
    if idx_TK.is_cuda:
        return route_device(idx_TK, plan_EDD, rank=rank, local_E=local_E)
    if _fastroute is None:
        return route_reference(idx_TK, plan_EDD, rank=rank, local_E=local_E)
    e_A = np.ascontiguousarray(idx_TK.to("cpu", torch.long).reshape(-1).numpy())
    num_experts, num_ranks, _ = plan_EDD.shape
    K = idx_TK.shape[1]
    dense = isinstance(plan_EDD, torch.Tensor)
    mine_ED = np.ascontiguousarray((plan_EDD[:, rank, :] if dense else plan_EDD.sent(rank)).numpy())
    recv_DE = np.ascontiguousarray((plan_EDD[:, :, rank] if dense else plan_EDD.received(rank)).numpy().T)
    local_S = np.ascontiguousarray(local_E.to("cpu", torch.long).numpy())
    recv_E = recv_DE.sum(0)
    held_E = np.zeros(num_experts, dtype=bool)
    held_E[local_S] = True
    if recv_E[~held_E].any():
        raise RuntimeError(f"rank {rank} is sent tokens for experts it does not hold: "
                           f"{np.flatnonzero(~held_E & (recv_E > 0)).tolist()}")
    A, R = e_A.size, int(recv_E.sum())
    out = np.empty(2 * A + 2 * R, dtype=np.int64)
    if not _fastroute.route_orders(e_A, K, mine_ED, recv_DE, local_S, out, num_experts, num_ranks):
        bad = e_A[(e_A < 0) | (e_A >= num_experts)]
        if bad.size:
            raise RuntimeError(f"rank {rank}: routed expert indices {bad[:8].tolist()} are not in [0, {num_experts})")
        raise RuntimeError(f"rank {rank}: routed counts {np.bincount(e_A, minlength=num_experts).tolist()} disagree "
                           f"with the dispatch plan {mine_ED.sum(1).tolist()}")
    send_token, unsend, group_perm, ungroup_perm = (torch.from_numpy(v) for v in np.split(out, [A, 2 * A, 2 * A + R]))
    return Route(send_token=send_token, send_splits=mine_ED.sum(0).tolist(), unsend=unsend,
                 recv_splits=recv_DE.sum(1).tolist(), group_perm=group_perm, ungroup_perm=ungroup_perm,
                 group_sizes=recv_E[local_S].tolist())


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

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

    Linear time, in numpy (small index arrays: torch's per-call cost would dominate): one stable
    sort of the assignments by expert (a radix sort), then every other order is a reordering of
    runs whose lengths the plan gives. :func:`route_reference` sorts keys instead (same result,
    several times slower on a CPU)."""
    e_A = idx_TK.to("cpu", torch.long).reshape(-1).numpy()
    num_experts, num_ranks, _ = plan_EDD.shape
    K = idx_TK.shape[1]
    dense = isinstance(plan_EDD, torch.Tensor)
    mine_ED = (plan_EDD[:, rank, :] if dense else plan_EDD.sent(rank)).numpy()
    counts_E = np.bincount(e_A, minlength=num_experts)
    if not np.array_equal(counts_E, mine_ED.sum(1)):
        raise RuntimeError(f"rank {rank}: routed counts {counts_E.tolist()} disagree with the dispatch plan "
                           f"{mine_ED.sum(1).tolist()}")

    # Sorted by expert (stable: token order inside an expert), each expert's block is cut into
    # runs per destination: runs (e, d) of mine_ED[e, d] rows. The send order is the same runs
    # taken destination-major.
    by_expert = np.argsort(e_A.astype(np.int16) if num_experts <= 1 << 15 else e_A, kind="stable")  # radix
    sorted_start_ED = _exclusive_cumsum(mine_ED.ravel()).reshape(mine_ED.shape)
    send_assign = by_expert[_runs(sorted_start_ED.T.ravel(), mine_ED.T.ravel())]

    # Received: runs (source d, expert e) of recv_DE[d, e] rows; computed: slot-major (the
    # experts held here, in local_E's order), then source.
    recv_DE = (plan_EDD[:, :, rank] if dense else plan_EDD.received(rank)).numpy().T
    local = local_E.to("cpu", torch.long).numpy()
    recv_E = recv_DE.sum(0)
    held = np.zeros(num_experts, dtype=bool)
    held[local] = True
    if recv_E[~held].any():
        raise RuntimeError(f"rank {rank} is sent tokens for experts it does not hold: "
                           f"{np.flatnonzero(~held & (recv_E > 0)).tolist()}")
    recv_start_DE = _exclusive_cumsum(recv_DE.ravel()).reshape(recv_DE.shape)
    group_perm = _runs(recv_start_DE[:, local].T.ravel(), recv_DE[:, local].T.ravel())
    return Route(send_token=torch.from_numpy(send_assign // K), send_splits=mine_ED.sum(0).tolist(),
                 unsend=torch.from_numpy(_inverse(send_assign)), recv_splits=recv_DE.sum(1).tolist(),
                 group_perm=torch.from_numpy(group_perm), ungroup_perm=torch.from_numpy(_inverse(group_perm)),
                 group_sizes=recv_E[local].tolist())


def _exclusive_cumsum(x_R: np.ndarray) -> np.ndarray:
    return np.cumsum(x_R) - x_R


def _runs(start_R: np.ndarray, len_R: np.ndarray) -> np.ndarray:
    """The ranges [start, start + len) of the runs, concatenated in the order given (int64)."""
    return np.repeat(start_R - _exclusive_cumsum(len_R), len_R) + np.arange(int(len_R.sum()), dtype=np.int64)


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv


def route_reference(idx_TK: torch.Tensor, plan_EDD, *, rank: int, local_E: torch.Tensor) -> Route:
    """:func:`route` by sorting keys: the specification it is tested against."""
    idx_TK = idx_TK.to("cpu", torch.long)
    num_experts, num_ranks, _ = plan_EDD.shape
    K = idx_TK.shape[1]
    e_A = idx_TK.reshape(-1)
    dense = isinstance(plan_EDD, torch.Tensor)
    mine_ED = plan_EDD[:, rank, :] if dense else plan_EDD.sent(rank)
    counts_E = torch.bincount(e_A, minlength=num_experts)
    if not torch.equal(counts_E, mine_ED.sum(1)):
        raise RuntimeError(f"rank {rank}: routed counts {counts_E.tolist()} disagree with the dispatch plan "
                           f"{mine_ED.sum(1).tolist()}")

    # Sort assignments by expert (stable: token order inside an expert), then cut each expert's
    # block into consecutive runs per destination, in destination order.
    by_expert = torch.sort(e_A, stable=True).indices
    e_sorted = e_A[by_expert]
    start_E = torch.cumsum(counts_E, 0) - counts_E
    pos = torch.arange(e_A.numel()) - start_E[e_sorted]
    cum_ED = torch.cumsum(mine_ED, 1)
    dest = torch.searchsorted(cum_ED[e_sorted], pos.unsqueeze(1), right=True).squeeze(1)
    send_perm = torch.sort(dest * num_experts + e_sorted, stable=True).indices
    send_assign = by_expert[send_perm]
    unsend = torch.empty_like(send_assign)
    unsend[send_assign] = torch.arange(send_assign.numel())

    recv_DE = (plan_EDD[:, :, rank] if dense else plan_EDD.received(rank)).t()  # rows from each source, per expert
    slot_E = torch.full((num_experts,), -1, dtype=torch.long)
    slot_E[local_E] = torch.arange(local_E.numel())
    held = slot_E >= 0
    if bool(recv_DE[:, ~held].any()):
        missing = torch.nonzero(recv_DE[:, ~held].sum(0)).flatten()
        raise RuntimeError(f"rank {rank} is sent tokens for experts it does not hold: "
                           f"{torch.arange(num_experts)[~held][missing].tolist()}")
    key_DE = slot_E.unsqueeze(0) * num_ranks + torch.arange(num_ranks).unsqueeze(1)
    row_key = torch.repeat_interleave(key_DE.reshape(-1), recv_DE.reshape(-1))
    group_perm = torch.sort(row_key, stable=True).indices
    ungroup_perm = torch.empty_like(group_perm)
    ungroup_perm[group_perm] = torch.arange(group_perm.numel())
    return Route(send_token=send_assign // K, send_splits=torch.bincount(dest, minlength=num_ranks).tolist(),
                 unsend=unsend, recv_splits=recv_DE.sum(1).tolist(), group_perm=group_perm,
                 ungroup_perm=ungroup_perm, group_sizes=recv_DE.sum(0)[local_E].tolist())

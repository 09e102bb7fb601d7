"""Index math for token permutation (no communication): per-expert counts and offsets, each
assignment's destination rank from the dispatch plan, and the send layout.

Legend: T tokens, K top-k, A = T * K assignments (a = t * K + k), E experts, D destination
ranks, S sent rows.

Send order: destination rank, then expert, then token (the order ``ds_fssdp.moe.routing`` uses).
With ``dedup`` a token is sent once per destination, however many of its experts live there; the
row is ordered by the smallest of those experts.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from ds_fssdp.ops.dispatch import backend_for


@dataclass
class PermuteLayout:
    token_S: torch.Tensor  # long [S]: token carried by each sent row, in send order
    splits_D: torch.Tensor  # long [D]: sent rows per destination (a device tensor; .tolist() syncs)
    row_TK: torch.Tensor  # long [T, K]: the sent row carrying assignment (t, k)
    first_TK: torch.Tensor  # long [T, K]: row_TK where (t, k) is t's first assignment to that
    # destination, else -1; every sent row appears here exactly once


def expert_counts(idx_TK: torch.Tensor, num_experts: int) -> tuple:
    """(counts_E, offsets_E), long: assignments per expert and their exclusive cumsum. Ids must be
    in [0, E). Example, E 3: idx [[2, 0], [2, 2]] -> counts [1, 0, 3], offsets [0, 1, 1]."""
    idx_A = idx_TK.reshape(-1)
    if backend_for(idx_A.device) == "triton":
        kernels = importlib.import_module("ds_fssdp.ops.triton.permute_kernels")
        return kernels.expert_counts(idx_A.contiguous(), num_experts)
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=idx_A.device)
    counts_E.index_add_(0, idx_A.long(), torch.ones_like(idx_A, dtype=torch.long))
    return counts_E, torch.cumsum(counts_E, 0) - counts_E


def assignment_dest(idx_TK: torch.Tensor, plan_ED: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """dest_TK: the rank that computes each assignment. ``plan_ED[e, d]`` (this rank's row of the
    dispatch plan, ``plan_EDD[:, rank, :]``) tokens of expert e go to rank d: expert e's
    assignments, in token order, are cut into consecutive runs per destination, in rank order.

    ``check`` compares the routed counts with the plan (a host sync on CUDA).
    Example: idx [[0], [0], [1]], plan [[1, 1], [0, 1]] -> dest [[0], [1], [1]].
    """
    T, K = idx_TK.shape
    E = plan_ED.shape[0]
    e_A = idx_TK.reshape(-1).long()
    counts_E, offsets_E = expert_counts(idx_TK, E)
    plan_ED = plan_ED.to(e_A.device, torch.long)
    if check and not torch.equal(counts_E, plan_ED.sum(1)):
        raise ValueError(f"routed counts per expert {counts_E.tolist()} disagree with the plan's "
                         f"{plan_ED.sum(1).tolist()}")
    by_expert_A = torch.sort(e_A, stable=True).indices
    e_sorted_A = e_A[by_expert_A]
    pos_A = torch.arange(e_A.numel(), device=e_A.device) - offsets_E[e_sorted_A]
    cum_ED = torch.cumsum(plan_ED, 1)
    dest_sorted_A = torch.searchsorted(cum_ED[e_sorted_A], pos_A.unsqueeze(1), right=True).squeeze(1)
    dest_A = torch.empty_like(dest_sorted_A)
    dest_A[by_expert_A] = dest_sorted_A
    return dest_A.reshape(T, K)


def permute_layout(idx_TK: torch.Tensor, dest_TK: torch.Tensor, *, num_dests: int, num_experts: int,
                   dedup: bool = True) -> PermuteLayout:
    """The send layout for experts ``idx_TK`` computed on ranks ``dest_TK``.

    Without ``dedup`` every assignment is a row (S = A; row_TK == first_TK, a permutation).
    With it, one row per (token, destination); S is known only after one host sync on CUDA.
    Example, dedup, D 2, E 3: idx [[1, 2], [0, 2]], dest [[1, 1], [0, 1]]
    -> rows (dest 0, e0, t1), (dest 1, e1, t0), (dest 1, e2, t1): token_S [1, 0, 1],
    splits [1, 2], row_TK [[1, 1], [0, 2]], first_TK [[1, -1], [0, 2]].
    """
    T, K = idx_TK.shape
    dev = idx_TK.device
    idx_TK, dest_TK = idx_TK.long(), dest_TK.long()
    k_K = torch.arange(K, device=dev)
    if dedup:
        same_TKK = dest_TK.unsqueeze(2) == dest_TK.unsqueeze(1)  # [t, k, k']: same destination
        first_k_TK = same_TKK.to(torch.uint8).argmax(2)  # the first k' (argmax returns the first max)
        is_first_TK = first_k_TK == k_K
        order_e_TK = torch.where(same_TKK, idx_TK.unsqueeze(1), num_experts).amin(2)
    else:
        first_k_TK = k_K.expand(T, K)
        is_first_TK = torch.ones(T, K, dtype=torch.bool, device=dev)
        order_e_TK = idx_TK
    t_TK = torch.arange(T, device=dev).unsqueeze(1)
    key_TK = (dest_TK * num_experts + order_e_TK) * T + t_TK
    key_TK = torch.where(is_first_TK, key_TK, num_dests * num_experts * T)  # non-first rows sort last
    order_A = torch.sort(key_TK.reshape(-1), stable=True).indices
    S = T * K if not dedup else int(is_first_TK.sum())
    rank_A = torch.empty_like(order_A)
    rank_A[order_A] = torch.arange(T * K, device=dev)
    row_TK = rank_A.reshape(T, K).gather(1, first_k_TK)
    splits = torch.zeros(num_dests + 1, dtype=torch.long, device=dev)
    splits.index_add_(0, torch.where(is_first_TK, dest_TK, num_dests).reshape(-1),
                      torch.ones(T * K, dtype=torch.long, device=dev))
    return PermuteLayout(token_S=order_A[:S] // K, splits_D=splits[:num_dests], row_TK=row_TK,
                         first_TK=torch.where(is_first_TK, row_TK, -1))

"""One copy per destination: the index math that sends a token to a rank once, whatever number of
its top-k experts that rank computes (no communication; the dispatcher runs the exchanges).

Legend: T tokens, K top-k, A = T * K assignments, D ranks, U unique (token, destination) rows
(sent: this rank's; received: from every source), C compute rows (one per assignment received).

A :class:`~ds_fssdp.moe.routing.Route` sends one row per assignment in the order (destination,
expert, token). Here the sender sends one row per (token, destination) pair instead, in the order
(destination, token), with K routing entries per row (``meta_UK``): for each of the token's k
slots that this destination computes, the slot's position in the route's send block for that
destination, else -1. That position is, by the route's construction, the row's position in the
receiver's receive block from this source, so the receiver turns it into the route's compute
position (``ungroup_perm``) and the expert compute sees exactly the rows, in exactly the order,
of the per-assignment path. The receiver combines each unique row's expert outputs with their
gate weights (k order) into one returned row; the sender sums the returned rows of a token over
its destinations (destination order).

Tables (every index -1 where there is no entry, as ``ops`` expects):
  sender    token_U [U]: token of each sent row;  uniq_TK [T, K]: a token's sent rows in
            destination order;  meta_UK [U, K];  splits [D]: rows per destination
  receiver  rows_UK [U, K]: compute position of each received row's slot k;  token_C [C]: the
            received row each compute row expands from
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_fssdp.moe.routing import Route
from ds_fssdp.ops.permute_torch import invert_rows


@dataclass
class SendTables:
    token_U: torch.Tensor  # long [U]
    uniq_TK: torch.Tensor  # long [T, K]
    meta_UK: torch.Tensor  # long [U, K]
    splits: list  # [D] unique rows per destination


@dataclass
class DedupRoute:
    """A :class:`Route` and its one-copy-per-destination tables (both sides). ``uniq_DD[s, d]``:
    unique rows rank s sends rank d (the whole group's, from the count all-gather)."""
    route: Route
    send: SendTables
    recv_splits: list  # [D] unique rows from each source
    rows_UK: torch.Tensor  # long [U_recv, K]
    token_C: torch.Tensor  # long [C]
    uniq_DD: torch.Tensor  # long [D, D], on the host


def send_tables(route: Route, num_tokens: int, k: int) -> SendTables:
    """The sender's tables from its route (torch ops on the route's device)."""
    unsend_A = route.unsend
    dev = unsend_A.device
    T, K, D = num_tokens, k, len(route.send_splits)
    split_D = torch.tensor(route.send_splits, dtype=torch.long, device=dev)
    end_D = torch.cumsum(split_D, 0)
    dest_A = torch.searchsorted(end_D, unsend_A, right=True)
    pos_A = unsend_A - (end_D - split_D)[dest_A]
    a = torch.arange(T * K, device=dev)
    tok_A, k_A = a // K, a % K
    keys_U, u_A = torch.unique(dest_A * T + tok_A, sorted=True, return_inverse=True)
    token_U, dest_U = keys_U % max(T, 1), keys_U // max(T, 1)
    U = keys_U.numel()
    meta_UK = torch.full((U, K), -1, dtype=torch.long, device=dev)
    meta_UK[u_A, k_A] = pos_A
    # A token's rows in destination order: sort by (token, destination); j = rank within the token.
    by_token = torch.sort(token_U * D + dest_U, stable=True).indices
    tok_sorted = token_U[by_token]
    count_T = torch.bincount(token_U, minlength=T)
    j = torch.arange(U, device=dev) - (torch.cumsum(count_T, 0) - count_T)[tok_sorted]
    uniq_TK = torch.full((T, K), -1, dtype=torch.long, device=dev)
    uniq_TK[tok_sorted, j] = by_token
    return SendTables(token_U=token_U, uniq_TK=uniq_TK, meta_UK=meta_UK,
                      splits=torch.bincount(dest_U, minlength=D).tolist())


def receive_tables(route: Route, meta_UK: torch.Tensor, recv_splits: list, *, check: bool = True) -> tuple:
    """The receiver's ``(rows_UK, token_C)`` from the received routing entries ``meta_UK`` (each
    source's positions in its own block) and the unique rows per source. ``check`` (host tensors):
    every compute row is expanded from exactly one received row."""
    dev = meta_UK.device
    D = len(recv_splits)
    assign_D = torch.tensor(route.recv_splits, dtype=torch.long, device=dev)
    src_U = torch.repeat_interleave(torch.arange(D, device=dev), torch.tensor(recv_splits, device=dev))
    valid = meta_UK >= 0
    recv_UK = meta_UK + (torch.cumsum(assign_D, 0) - assign_D)[src_U].unsqueeze(1)
    ungroup = route.ungroup_perm.to(dev)
    rows_UK = torch.where(valid, ungroup[recv_UK.clamp(min=0)] if ungroup.numel() else recv_UK, -1)
    C, K = ungroup.numel(), meta_UK.shape[1]
    token_C = invert_rows(rows_UK, C) // K  # -1 // K == -1: a compute row no received row expands to
    if check and (int(valid.sum()) != C or bool((token_C < 0).any())):
        raise RuntimeError(f"one copy per destination: {int(valid.sum())} received routing entries for {C} compute rows")
    return rows_UK, token_C

"""Dispatch, expert compute and combine for one MoE layer, given a route and an exchange.

Legend: T tokens, K top-k, H hidden, R rows.

The same function serves the single-process layer (the exchange is the identity) and the
distributed one (the exchange is the uneven all-to-all), so both run the same expert math.
:func:`dispatch_compute_combine_dedup` is the one-copy-per-destination form (``moe/dedup.py``):
one row per (token, destination) crosses, the receiver expands it to its rows
(:func:`expand_received`) and combines their outputs with the gate weights into one returned
row (:func:`combine_received`); both take index tensors, so a chunked exchange can call them per
chunk. Every permutation here is an ``ops`` permutation (Triton on CUDA, the torch reference elsewhere):
the send buffer is gathered in the route's send order, the return is un-permuted and combined
over the top k in one pass (summed in k order), and both backwards gather instead of scattering.
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping, Optional

import torch

from ds_fssdp import ops
from ds_fssdp.moe.dedup import DedupRoute
from ds_fssdp.moe.routing import Route

Exchange = Callable[[torch.Tensor, list, list], torch.Tensor]
ExpertFn = Callable[[torch.Tensor, list], torch.Tensor]  # (rows grouped by local expert, group sizes) -> rows


def mlp_fn(expert_weights: Mapping[str, torch.Tensor], activation: str, *,
           act_params: Optional[Mapping[str, float]] = None, lora: Optional[Mapping] = None) -> ExpertFn:
    """``lora``: LoRA factors by weight name, stacked over the same local experts as the weights
    (``ops.expert_mlp``)."""
    return lambda x_RH, group_sizes: ops.expert_mlp(x_RH, expert_weights, group_sizes, activation=activation,
                                                    act_params=act_params, lora=lora)


def local_exchange(x_RH: torch.Tensor, out_splits: list, in_splits: list) -> torch.Tensor:
    return x_RH


def dispatch_compute_combine(x_TH: torch.Tensor, weights_TK: torch.Tensor, route: Route, *, expert_fn: ExpertFn,
                             exchange: Exchange) -> torch.Tensor:
    dev = x_TH.device
    T, K = weights_TK.shape
    # Each assignment's row in the send order: the combine's index, and the send buffer's backward.
    # The route computes it on first use, after the exchange is launched, so it is passed lazily.
    unsend_TK = functools.cache(lambda: route.unsend.to(dev).view(T, K))
    send_RH = ops.permute_tokens(x_TH, route.send_token, unsend_TK)
    recv_RH = exchange(send_RH, route.recv_splits, route.send_splits)
    # Received rows -> grouped by local expert and back: permutations, each the other's inverse.
    group_perm, ungroup_perm = route.group_perm.to(dev), route.ungroup_perm.to(dev)
    grouped_RH = ops.permute_tokens(recv_RH, group_perm, ungroup_perm.view(-1, 1))
    y_RH = expert_fn(grouped_RH, route.group_sizes)
    y_recv_RH = ops.permute_tokens(y_RH, ungroup_perm, group_perm.view(-1, 1))
    y_sent_RH = exchange(y_recv_RH, route.send_splits, route.recv_splits)
    return ops.unpermute_combine(y_sent_RH, unsend_TK(), weights_TK)


def expand_received(recv_UH: torch.Tensor, token_C: torch.Tensor, rows_UK: torch.Tensor) -> torch.Tensor:
    """Received unique rows -> compute rows (grouped by local expert): ``x_CH[c] = recv_UH[token_C[c]]``.
    The backward sums each received row's compute-row gradients in k order (``rows_UK``: the
    compute row of each received row's slot k, or -1), before the return exchange."""
    return ops.permute_tokens(recv_UH, token_C, rows_UK)


def combine_received(y_CH: torch.Tensor, rows_UK: torch.Tensor, weights_UK: torch.Tensor) -> torch.Tensor:
    """Expert outputs -> one returned row per received row: ``sum_k weights_UK[u, k] * y_CH[rows_UK[u, k]]``
    (k order, -1 skipped); gradients to ``y_CH`` and to the weights."""
    return ops.unpermute_combine(y_CH, rows_UK, weights_UK)


def hop_buffers(x_RH: torch.Tensor, w_RK: torch.Tensor, hop) -> tuple:
    """One hop's send buffers (``moe/dedup.Hop``): one row per (input row, destination) and its gate
    weights, which travel with it (with autograd), zero on the slots the row does not carry there."""
    dev = x_RH.device
    return ops.permute_tokens(x_RH, hop.token_U.to(dev), hop.uniq_TK.to(dev)), hop_weights(w_RK, hop)


def hop_weights(w_RK: torch.Tensor, hop) -> torch.Tensor:
    """A hop's gate weights in its send order (with autograd), zero on the slots a row does not
    carry there."""
    dev = w_RK.device
    return torch.where(hop.mask_UK.to(dev), ops.permute_tokens(w_RK, hop.token_U.to(dev), hop.uniq_TK.to(dev)), 0)


def exchange_with_weights(send_UH: torch.Tensor, w_UK: torch.Tensor, hop, exchange: Exchange) -> tuple:
    """One hop's rows and their gate weights over the exchange: as K more columns of the rows in
    one exchange (and one in the backward) when they share a dtype, the values unchanged; else
    two exchanges."""
    if w_UK.dtype != send_UH.dtype:
        return exchange(send_UH, hop.recv_splits, hop.splits), exchange(w_UK, hop.recv_splits, hop.splits)
    both_RX = exchange(torch.cat([send_UH, w_UK], 1), hop.recv_splits, hop.splits)
    H = send_UH.shape[1]
    return both_RX[:, :H], both_RX[:, H:]


def dispatch_compute_combine_dedup(x_TH: torch.Tensor, weights_TK: torch.Tensor, droute: DedupRoute, *,
                                   expert_fn: ExpertFn, exchange: Exchange) -> torch.Tensor:
    """:func:`dispatch_compute_combine` with one copy per destination (over one or two hops): the
    same expert rows in the same order; the top-k sum runs as per-destination partial sums (k
    order) summed over each hop's destinations in rank order (fp32 summation order differs from
    the per-assignment path's)."""
    dev = x_TH.device
    x_RH, w_RK = x_TH, weights_TK
    for hop in droute.hops:
        x_RH, w_RK = exchange_with_weights(*hop_buffers(x_RH, w_RK, hop), hop, exchange)
    rows_UK, token_C = droute.rows_UK.to(dev), droute.token_C.to(dev)
    y_CH = expert_fn(expand_received(x_RH, token_C, rows_UK), droute.route.group_sizes)
    out_RH = combine_received(y_CH, rows_UK, w_RK)
    for hop in reversed(droute.hops):  # each hop's sender sums a row's partial rows (destination order)
        out_RH = ops.unpermute_combine(exchange(out_RH, hop.splits, hop.recv_splits), hop.uniq_TK.to(dev))
    return out_RH

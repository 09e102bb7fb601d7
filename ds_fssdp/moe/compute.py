"""Dispatch, expert compute and combine for one MoE layer, given a route and an exchange.

Legend: T tokens, H hidden, R rows.

The same function serves the single-process layer (the exchange is the identity) and the
distributed one (the exchange is the uneven all-to-all), so both run the same expert math.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from ds_fssdp import ops
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
    send_RH = ops.permute_rows(x_TH, route.send_token.to(dev))
    recv_RH = exchange(send_RH, route.recv_splits, route.send_splits)
    grouped_RH = recv_RH.index_select(0, route.group_perm.to(dev))
    y_RH = expert_fn(grouped_RH, route.group_sizes)
    y_recv_RH = y_RH.index_select(0, route.ungroup_perm.to(dev))
    y_sent_RH = exchange(y_recv_RH, route.send_splits, route.recv_splits)
    y_AH = y_sent_RH.index_select(0, route.unsend.to(dev))
    return ops.combine_topk(y_AH, weights_TK)

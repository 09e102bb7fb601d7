"""One copy per destination: the index math that sends a token to a rank once, whatever number of
its top-k experts that rank computes, and, across nodes, over the inter-node link once per
destination node (no communication here; the dispatcher runs the exchanges).

Legend: T tokens (or a hop's input rows), K top-k, A = T * K assignments, D ranks, G ranks per
node, U unique rows of one hop, C compute rows (one per assignment this rank receives).

A :class:`~ds_fssdp.moe.routing.Route` sends one row per assignment in the order (destination,
expert, token). Here each of a token's k slots gets its destination rank and its **receive
position**: where the per-assignment path puts that assignment in the destination's receive
order (source, expert, token). Every rank knows it: the slot's position in the route's block for
that destination, plus the rows ranks before this one send there (the plan's traffic).

The rows then move in one or two **hops**. A hop sends one row per (input row, hop destination)
in the order (hop destination, input row), with the K slots' (final destination, receive
position), -1 where the slot goes elsewhere, and the gate weights (zero there):

* one hop: the hop destination is the final one;
* two hops (several nodes of several ranks, DeepEP): first to the relay in the destination's node
  with this rank's local index (a token crosses to a node once), then from the relay to the
  final destinations inside its node.

The final receiver maps each received slot's receive position to the route's compute position
(``ungroup_perm``), so the expert compute sees exactly the rows, in exactly the order, of the
per-assignment path; it combines each received row's outputs with their gate weights (k order)
into one returned row. The return runs the hops backwards, each hop's sender summing a row's
returned partial rows over the hop's destinations (destination order).

Tables (every index -1 where there is no entry, as ``ops`` expects):
  a hop     token_U [U]: input row of each sent row;  uniq_TK [T, K]: an input row's sent rows in
            destination order;  mask_UK [U, K]: the slots each sent row carries;  splits [D]
  receiver  rows_UK [U, K]: compute position of each received row's slot k;  token_C [C]: the
            received row each compute row expands from
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds_fssdp.moe.routing import Route
from ds_fssdp.ops.permute_torch import invert_rows


@dataclass
class Hop:
    """One exchange of unique rows, from this rank's side. ``recv_splits`` and ``uniq_DD`` (long
    [D, D] on the host: unique rows rank s sends rank d in this hop, the whole group's) come from
    the hop's count all-gather."""
    token_U: torch.Tensor  # long [U]
    uniq_TK: torch.Tensor  # long [T, K]
    mask_UK: torch.Tensor  # bool [U, K]
    splits: list  # [D] rows sent to each rank
    recv_splits: list = field(default_factory=list)  # [D] rows received from each rank
    uniq_DD: torch.Tensor | None = None
    # Staged (:func:`hop_tables` with ``stage_TK``): rows sent to each rank per stage (long [D, A],
    # host) and, from the count all-gather, rows received from each rank per stage (long [D, A]).
    stage_splits: torch.Tensor | None = None
    recv_stage_splits: torch.Tensor | None = None


@dataclass
class DedupRoute:
    """A :class:`Route`, the hops of its rows, and the final receiver's tables."""
    route: Route
    hops: list  # [Hop]
    rows_UK: torch.Tensor  # long [U_recv, K]
    token_C: torch.Tensor  # long [C]

    def rows_moved(self) -> list:
        """Rows that changed rank over the group, per hop."""
        return [int(h.uniq_DD.sum() - h.uniq_DD.diagonal().sum()) for h in self.hops]


def slot_targets(route: Route, num_tokens: int, k: int, offset_D: torch.Tensor) -> tuple:
    """``(dest_TK, pos_TK)``: each slot's destination rank and receive position there.
    ``offset_D[d]``: where this rank's block starts in rank d's receive order (rows that ranks
    before this one send rank d)."""
    unsend_A = route.unsend
    dev = unsend_A.device
    split_D = torch.tensor(route.send_splits, dtype=torch.long, device=dev)
    end_D = torch.cumsum(split_D, 0)
    dest_A = torch.searchsorted(end_D, unsend_A, right=True)
    pos_A = unsend_A - (end_D - split_D)[dest_A] + offset_D.to(dev)[dest_A]
    return dest_A.view(num_tokens, k), pos_A.view(num_tokens, k)


def relay_of(dest_TK: torch.Tensor, rank: int, ranks_per_node: int) -> torch.Tensor:
    """The first hop's destination of each slot: the rank of the destination's node with this
    rank's local index (-1 stays -1)."""
    G = ranks_per_node
    return torch.where(dest_TK >= 0, dest_TK // G * G + rank % G, -1)


def hop_tables(dest_TK: torch.Tensor, num_ranks: int, *, stage_TK: torch.Tensor | None = None,
               stages: int = 1) -> Hop:
    """One row per distinct (input row, destination) of ``dest_TK`` (long [T, K], -1: no slot),
    in the order (destination, input row); with ``stage_TK`` (long [T, K] in [0, ``stages``), the
    same for a row's slots to one destination: the sent row's stage, a relay's pipeline stage,
    ``moe/relay.py``) in the order (destination, stage, input row), so a stage is one block per
    destination (``Hop.stage_splits``)."""
    dev = dest_TK.device
    T, K = dest_TK.shape
    D = num_ranks
    valid = dest_TK >= 0
    t_TK = torch.arange(T, device=dev).unsqueeze(1).expand(T, K)
    S = 1 if stage_TK is None else int(stages)
    block_TK = dest_TK if stage_TK is None else dest_TK * S + stage_TK.to(dev)
    keys_U = torch.unique((block_TK * T + t_TK)[valid], sorted=True)
    token_U, block_U = (keys_U % T, keys_U // T) if T else (keys_U, keys_U)
    dest_U = block_U // S
    U = keys_U.numel()
    mask_UK = dest_TK[token_U] == dest_U.unsqueeze(1)
    # An input row's sent rows in destination order: sort by (row, destination); j = rank within the row.
    by_token = torch.sort(token_U * D + dest_U, stable=True).indices
    tok_sorted = token_U[by_token]
    count_T = torch.bincount(token_U, minlength=T)
    j = torch.arange(U, device=dev) - (torch.cumsum(count_T, 0) - count_T)[tok_sorted]
    uniq_TK = torch.full((T, K), -1, dtype=torch.long, device=dev)
    uniq_TK[tok_sorted, j] = by_token
    hop = Hop(token_U=token_U, uniq_TK=uniq_TK, mask_UK=mask_UK, splits=torch.bincount(dest_U, minlength=D).tolist())
    if stage_TK is not None:
        hop.stage_splits = torch.bincount(block_U, minlength=D * S).view(D, S).cpu()
    return hop


def hop_entries(hop: Hop, *fields_TK: torch.Tensor) -> torch.Tensor:
    """The routing entries a hop sends with its rows: each field's values at the row's slots, -1 at
    the others, side by side (long [U, K * len(fields)])."""
    return torch.cat([torch.where(hop.mask_UK, f[hop.token_U], -1) for f in fields_TK], 1)


def receive_tables(route: Route, pos_UK: torch.Tensor, *, check: bool = True) -> tuple:
    """The final receiver's ``(rows_UK, token_C)`` from the received rows' receive positions
    (-1: another rank's slot). ``check`` (host tensors): every compute row is expanded from
    exactly one received slot."""
    dev = pos_UK.device
    valid = pos_UK >= 0
    ungroup = route.ungroup_perm.to(dev)
    rows_UK = torch.where(valid, ungroup[pos_UK.clamp(min=0)], -1) if ungroup.numel() else pos_UK.clone()
    C, K = ungroup.numel(), pos_UK.shape[1]
    token_C = invert_rows(rows_UK, C) // K  # -1 // K == -1: a compute row no received slot expands to
    if check and (int(valid.sum()) != C or bool((token_C < 0).any())):
        raise RuntimeError(f"one copy per destination: {int(valid.sum())} received routing entries for {C} "
                           "compute rows")
    return rows_UK, token_C

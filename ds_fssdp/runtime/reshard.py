"""Heterogeneous re-sharding in the runtime: new owners for every layer, state migrated
(``expert_dp.migrate`` moves each tensor with :func:`migrate_rows`).

Legend: E experts, D ranks, S rows owned before, S2 rows owned after, P elements per expert.

Every ``reshard_interval`` optimizer steps the owners of all layers are re-planned with
Algorithm 2 on the predictor's loads, and each expert whose owner changes moves its whole state
to the new owner: the compute rows, the fp32 master, and every optimizer tensor shaped like the
master (Adam moments, SGD momentum). Rows that stay do not move. One all-to-all per tensor per
layer; this is on the critical path, which is why it happens rarely (paper section 4.3).
"""
from __future__ import annotations

import torch
from deepspeed import comm as dist


@torch.no_grad()
def migrate_rows(rows_SP: torch.Tensor, old_owner_E: torch.Tensor, new_owner_E: torch.Tensor, *, rank: int,
                 group) -> tuple:
    """This rank's rows under ``old_owner_E`` -> its rows under ``new_owner_E`` (experts ascending).
    Returns (rows [S2, P], bytes this rank sent)."""
    world = dist.get_world_size(group=group)
    old_E = torch.nonzero(old_owner_E == rank).flatten()
    new_E = torch.nonzero(new_owner_E == rank).flatten()
    leaving = [(int(new_owner_E[e]), i, int(e)) for i, e in enumerate(old_E.tolist()) if new_owner_E[e] != rank]
    leaving.sort(key=lambda t: (t[0], t[2]))
    send_rows = torch.tensor([i for _, i, _ in leaving], dtype=torch.long)
    send_splits = [sum(1 for dst, _, _ in leaving if dst == r) for r in range(world)]
    arriving = sorted((int(old_owner_E[e]), int(e)) for e in new_E.tolist() if old_owner_E[e] != rank)
    recv_splits = [sum(1 for src, _ in arriving if src == r) for r in range(world)]
    send = rows_SP.index_select(0, send_rows.to(rows_SP.device))
    recv = rows_SP.new_empty(len(arriving), rows_SP.shape[1])
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    out = rows_SP.new_empty(new_E.numel(), rows_SP.shape[1])
    new_pos = {e: j for j, e in enumerate(new_E.tolist())}
    old_pos = {e: i for i, e in enumerate(old_E.tolist())}
    stay = [(new_pos[e], old_pos[e]) for e in new_E.tolist() if e in old_pos]
    if stay:
        dst_idx, src_idx = (torch.tensor(v, dtype=torch.long, device=rows_SP.device) for v in zip(*stay))
        out.index_copy_(0, dst_idx, rows_SP.index_select(0, src_idx))
    if arriving:
        out.index_copy_(0, torch.tensor([new_pos[e] for _, e in arriving], device=rows_SP.device), recv)
    return out, send.numel() * send.element_size()


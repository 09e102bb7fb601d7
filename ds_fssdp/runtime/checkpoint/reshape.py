"""Loading on another world size: which rank owns which expert after a load, reading any expert's
rows from whichever per-rank files hold them, and the predictor's windows without the per-rank
split. Legend: E experts, S rows a rank needs, P elements per expert."""
from __future__ import annotations

import os

import torch

from ds_fssdp.planner import homogeneous_owner
from ds_fssdp.runtime.checkpoint.files import CheckpointError, load_file
from ds_fssdp.runtime.checkpoint.layout import META, rank_file


def same_groups(meta: dict, *, world: int, group_size: int) -> bool:
    """Saved on the same data-parallel size ``world`` (the world size, or under pipeline
    parallelism a stage's data-parallel ranks) and FSSDP group size (older checkpoints: one group)."""
    return meta.get("dp_size", meta["world_size"]) == world and meta.get("group_size", meta["world_size"]) == group_size


def owners_after_load(meta: dict, saved_owner_E: torch.Tensor, *, world: int, group_size: int,
                      ranks_per_node: int) -> torch.Tensor:
    """The saved owners when the world size, the group size and ``ranks_per_node`` are the same
    (exact resume, also after a re-shard); otherwise the homogeneous owners of the new FSSDP group."""
    if same_groups(meta, world=world, group_size=group_size) and meta["ranks_per_node"] == ranks_per_node:
        return saved_owner_E.clone()
    return homogeneous_owner(saved_owner_E.numel(), group_size)


def gather_rows(files, layer: int, *, saved_owner_E, need_E, numel: int, keys, base: int = 0) -> tuple:
    """Rows [S, P] of the experts ``need_E`` (ascending) and their optimizer rows by key: ``layer``
    is the position in the files of ranks ``base + owner`` (a pipeline stage's first rank,
    ``checkpoint/pipeline.py``)."""
    master_SP = torch.empty(need_E.numel(), numel, dtype=torch.float32)
    rows = {k: torch.empty(need_E.numel(), numel, dtype=torch.float32) for k in keys}
    src_S = saved_owner_E[need_E]
    for src in torch.unique(src_S).tolist():
        sel = torch.nonzero(src_S == src).flatten()
        saved = files[base + src]["layers"][layer]
        expect_E = torch.nonzero(saved_owner_E == src).flatten()
        if not torch.equal(saved["experts"], expect_E) or saved["master"].shape != (expect_E.numel(), numel):
            raise CheckpointError(f"{files.path(base + src)}: layer {layer} holds experts {saved['experts'].tolist()} "
                                  f"({tuple(saved['master'].shape)}), {META} says {expect_E.tolist()}")
        pos = torch.searchsorted(expect_E, need_E[sel])
        master_SP[sel] = saved["master"].index_select(0, pos).float()
        for k in keys:
            if k not in saved["optimizer_rows"]:
                raise CheckpointError(f"{files.path(base + src)}: layer {layer} lacks optimizer state {k!r}")
            rows[k][sel] = saved["optimizer_rows"][k].index_select(0, pos).to(rows[k].dtype)
    return master_SP, rows


def predictor_for(state: dict, same_world: bool) -> dict:
    if same_world:
        return state
    # Per-rank token counts of another world say nothing about this one; the per-expert totals do.
    # The errors are of per-expert loads: they hold in any world.
    return {"window": state["window"],
            "history": [[h.sum(1, keepdim=True) if h.dim() == 2 else h for h in hist] for hist in state["history"]],
            "errors": state.get("errors", [])}


class RankFiles:
    """Per-rank files, each opened once (memory-mapped: only the rows read are paged in)."""

    def __init__(self, root: str):
        self.root = root
        self._open = {}

    def path(self, rank: int) -> str:
        return os.path.join(self.root, rank_file(rank))

    def __getitem__(self, rank: int) -> dict:
        if rank not in self._open:
            self._open[rank] = load_file(self.path(rank), mmap=True)
        return self._open[rank]

"""DeepSpeed AutoTP (``tensor_parallel.autotp_size``) with FSSDP experts: the folding
(docs/design.md section 5, "AutoTP").

Legend: W ranks in the world, p ranks per tensor-parallel (TP) group, W / p data-parallel ranks.

Every TP rank holds the same tokens, so each FSSDP layer folds (``comm/fold.py``): it routes all
tokens, dispatches only this TP rank's slice and all-gathers the outputs over the TP group. The
FSSDP groups span the TP lanes, so every token reaches its experts once, and the expert gradients,
summed over all W ranks, hold each data-parallel batch once: divided by W / p (``tp_grad_scale``),
DeepSpeed's average over its data-parallel ranks, they equal single-process training.
"""
from __future__ import annotations

from ds_fssdp.comm.fold import TPFold
from ds_fssdp.config import FSSDPConfigError


def tensor_parallel_size(ds_config: dict) -> int:
    """p from ``tensor_parallel.autotp_size`` (1 when off). SP with TP is refused in
    ``sequence_parallel.py``; ZeRO 0-3 all fold alike."""
    tp = ds_config.get("tensor_parallel") or {}
    size = tp.get("autotp_size", 0) if isinstance(tp, dict) else 0
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise FSSDPConfigError(f"tensor_parallel.autotp_size ({size!r}) must be an integer >= 0")
    return max(size, 1)


def tp_grad_scale(*, world: int, tp: int) -> float:
    """DeepSpeed averages the dense gradients over the W / p data-parallel ranks."""
    return tp / world


def attach_fold(layers: list, *, tp_group, tp_size: int, tp_rank: int) -> TPFold:
    """Fold every FSSDP layer over ``tp_group`` (AutoTP's, created by ``deepspeed.initialize``)."""
    fold = TPFold(group=tp_group, size=tp_size, rank=tp_rank)
    for layer in layers:
        layer.fold = fold
    return fold

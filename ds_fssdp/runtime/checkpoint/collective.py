"""Agreement between ranks during a save or load: a failure on any rank fails every rank alike (a
process without distributed comm is the one rank)."""
from __future__ import annotations

import torch.distributed as tdist
from deepspeed import comm as dist

from ds_fssdp.runtime.checkpoint.files import CheckpointError


def attempt(fn):
    """Run ``fn``; return None, or the exception it raised (to be agreed on by all ranks)."""
    try:
        fn()
    except Exception as err:  # re-raised on every rank by agree
        return err
    return None


def agreed(what: str, fn, *, root_only: bool = False) -> None:
    """Run ``fn`` (on rank 0 alone with ``root_only``) and :func:`agree` on its outcome."""
    agree(what, attempt(fn) if not root_only or rank() == 0 else None)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def agree(what: str, err) -> None:
    """Every rank learns whether any failed and then raises alike (no rank is left waiting in a
    later collective)."""
    messages = all_gather(None if err is None else f"{type(err).__name__}: {err}")
    failed = {r: m for r, m in enumerate(messages) if m is not None}
    if failed:
        text = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {text}") from err


def all_gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def broadcast(obj):
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]

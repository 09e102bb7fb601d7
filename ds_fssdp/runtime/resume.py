"""Save-and-resume for training loops: ``resume`` continues from the newest complete checkpoint and
returns the step to continue from; ``save_step`` saves one (tag ``global_step<N>``) with the loop's
own state in DeepSpeed's ``client_state`` and prunes the old ones once it is complete.

    sampler = WindowSampler(...)                                  # anything with state_dict()
    start = ds_fssdp.resume(engine, save_dir, state={"sampler": sampler})
    for step in range(start, steps):
        ...                                                       # engine(x); backward; step
        if (step + 1) % interval == 0:
            ds_fssdp.save_step(engine, save_dir, step + 1, state={"sampler": sampler}, keep_last=3)

The loop's state objects must be the same on every rank (rank 0's copy is saved, as DeepSpeed
saves ``client_state``). Both functions are collective (every rank calls them).
"""
from __future__ import annotations

import os
import re
import shutil

from deepspeed import comm as dist
from deepspeed.utils import logger

from ds_fssdp.runtime.checkpoint import (LATEST, MANIFEST, OLD_PREFIX, TMP_PREFIX, CheckpointError, read_manifest,
                                         read_meta, resolve_tag, verify_files)
from ds_fssdp.runtime.checkpoint.collective import broadcast
from ds_fssdp.runtime.checkpoint.files import read_text

CLIENT_KEY = "fssdp_resume"  # this module's entry in client_state
TAG = "global_step{}"
WHICH = ("latest", "latest-valid")
_TAG_RE = re.compile(r"^global_step(\d+)$")
_PRUNED = ".pruned-"
_DERIVED = (OLD_PREFIX, ".universal-", ".universal-tmp-")  # directories that belong to a tag


def resume(engine, save_dir: str, *, state: dict | None = None, which: str = "latest", **load_kwargs) -> int:
    """Load the newest complete checkpoint of ``save_dir`` into ``engine`` and ``state``; return the
    step to continue from (0 when there is none yet).

    ``which="latest"``: the checkpoint ``latest`` names (else the newest complete one); if it fails
    its checks, raise :class:`CheckpointError` naming the file. ``"latest-valid"``: fall back to the
    newest one that passes them, reporting each one skipped by name. Another world size is fine
    (``engine.load_checkpoint`` converts). ``load_kwargs`` go to ``engine.load_checkpoint``."""
    if which not in WHICH:
        raise ValueError(f"which ({which!r}) must be one of {WHICH}")
    candidates = broadcast(_candidates(save_dir) if dist.get_rank() == 0 else None)
    if not candidates:
        if dist.get_rank() == 0:
            logger.info(f"fssdp: no checkpoint in {save_dir}; starting from step 0")
        return 0
    tag = newest_valid(candidates, lambda t: _verify(save_dir, t), which=which,
                       where=lambda t: os.path.join(save_dir, t), log=dist.get_rank() == 0)
    load_kwargs.setdefault("verify", False)  # just verified
    _, client_state = engine.load_checkpoint(save_dir, tag=tag, **load_kwargs)
    return _restore(client_state or {}, state or {}, engine=engine, where=os.path.join(save_dir, tag))


def newest_valid(candidates: list, check, *, which: str, where=str, log: bool = True):
    """The first of ``candidates`` (newest first) that ``check`` passes (it raises
    :class:`CheckpointError` otherwise); None when there are none. With ``which="latest"`` the
    first failure raises, naming the checkpoint (``where(candidate)``) and the file; with
    ``"latest-valid"`` each failing one is reported and skipped, and only the last one's failure
    raises."""
    if which not in WHICH:
        raise ValueError(f"which ({which!r}) must be one of {WHICH}")
    for i, candidate in enumerate(candidates):
        try:
            check(candidate)
            return candidate
        except CheckpointError as err:
            if which == "latest-valid" and i + 1 < len(candidates):
                if log:
                    logger.warning(f"fssdp: skipping checkpoint {where(candidate)}: {err}")
                continue
            hint = "" if which == "latest-valid" else " (resume with latest-valid to fall back to an older one)"
            raise CheckpointError(f"newest checkpoint {where(candidate)} is not valid{hint}: {err}") from err
    return None


def save_step(engine, save_dir: str, step: int, *, state: dict | None = None, keep_last: int | None = None,
              async_save: bool = False) -> str:
    """Save checkpoint ``global_step<step>`` with ``state`` (objects with ``state_dict``) and the
    step in ``client_state``; then keep only the ``keep_last`` newest complete checkpoints. A
    failed save (a full disk) raises :class:`CheckpointError` on every rank, leaves the previous
    checkpoints as they were and removes its unfinished files, so training can go on.
    ``async_save``: stage the state now and write it in the background (``engine.save_checkpoint``);
    its failure is raised by the next save or ``engine.wait_for_checkpoint()``, and pruning counts
    only committed checkpoints, so the one being written never lets an older one go."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last ({keep_last}) must be >= 1 (or None: keep every checkpoint)")
    tag = TAG.format(step)
    client_state = {CLIENT_KEY: {"step": int(step), "state": {k: v.state_dict() for k, v in (state or {}).items()}}}
    try:
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, async_save=async_save)
    except CheckpointError:
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(save_dir, TMP_PREFIX + tag), ignore_errors=True)  # give the space back
        dist.barrier()  # every rank sees the directory as rank 0 left it
        raise
    if keep_last is not None and dist.get_rank() == 0:
        prune(save_dir, keep_last=keep_last)
    return tag


def prune(save_dir: str, *, keep_last: int) -> list:
    """Delete all but the ``keep_last`` newest complete ``global_step<N>`` checkpoints (never the one
    ``latest`` names), their derived directories and unfinished saves older than the newest kept
    one. Each is first renamed to ``.pruned-<tag>`` (atomic), so a crash here never leaves a
    half-deleted checkpoint under its own name. Rank 0 only; returns the tags removed."""
    complete = sorted((s, t) for t in _complete(save_dir) if (s := _step(t)) is not None)
    latest = _read_latest(save_dir)
    keep = {t for _, t in complete[-keep_last:]} | ({latest} if latest else set())
    newest = complete[-1][0] if complete else -1
    removed = [t for _, t in complete if t not in keep]
    doomed = list(removed)
    for name in os.listdir(save_dir):
        if name.startswith(_PRUNED):
            doomed.append(name)  # left by a crash during an earlier prune
        elif name.startswith(TMP_PREFIX) and (s := _step(name[len(TMP_PREFIX):])) is not None and s < newest:
            doomed.append(name)
        for prefix in _DERIVED:
            if name.startswith(prefix) and name[len(prefix):] in removed:
                doomed.append(name)
    for name in doomed:
        path = os.path.join(save_dir, name)
        if not name.startswith(_PRUNED):
            os.rename(path, os.path.join(save_dir, _PRUNED + name))
            path = os.path.join(save_dir, _PRUNED + name)
        shutil.rmtree(path)
    if removed:
        logger.info(f"fssdp: pruned checkpoints {removed} in {save_dir} (keeping the {keep_last} newest)")
    return removed


def _candidates(save_dir: str) -> list:
    """Tags to try, newest first: the one ``latest`` names, then every other complete checkpoint
    by its step. A ``latest`` that names a checkpoint that is gone is the first candidate anyway
    (its check reports it)."""
    if not os.path.isdir(save_dir):
        return []
    latest = _read_latest(save_dir)
    others = sorted(_complete(save_dir), key=lambda t: (_saved_step(save_dir, t), t), reverse=True)
    return ([latest] if latest else []) + [t for t in others if t != latest]


def _complete(save_dir: str) -> list:
    return [t for t in os.listdir(save_dir)
            if not t.startswith(".") and os.path.isfile(os.path.join(save_dir, t, MANIFEST))]


def _verify(save_dir: str, tag: str) -> None:
    """Every rank raises the same CheckpointError for a bad checkpoint (the files are on a shared
    filesystem; the digests are checked in shares and agreed on)."""
    root = os.path.join(save_dir, resolve_tag(save_dir, tag))
    manifest = read_manifest(root)
    read_meta(root)
    verify_files(root, manifest, digests=True, group_ranks=True)


def _restore(client_state: dict, state: dict, *, engine, where: str) -> int:
    saved = client_state.get(CLIENT_KEY)
    if saved is None:
        if state:
            raise CheckpointError(f"{where} was not saved by ds_fssdp.save_step: it holds no state for "
                                  f"{sorted(state)}")
        return int(engine.global_steps)
    missing = sorted(set(state) - set(saved["state"]))
    if missing:
        raise CheckpointError(f"{where} holds no state for {missing} (saved: {sorted(saved['state'])})")
    for name, obj in state.items():
        obj.load_state_dict(saved["state"][name])
    if dist.get_rank() == 0:
        logger.info(f"fssdp: resuming from {where} at step {saved['step']}")
    return int(saved["step"])


def _read_latest(save_dir: str):
    path = os.path.join(save_dir, LATEST)
    return (read_text(path).strip() or None) if os.path.isfile(path) else None


def _step(tag: str):
    m = _TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def _saved_step(save_dir: str, tag: str) -> int:
    step = _step(tag)
    if step is not None:
        return step
    try:
        return int(read_meta(os.path.join(save_dir, tag)).get("global_steps", -1))
    except CheckpointError:
        return -1

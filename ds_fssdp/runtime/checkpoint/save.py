"""Saving: DeepSpeed's own files plus every expert's rows keyed by (layer, expert), written into
``.tmp-<tag>`` and committed by renames once every rank has written and the manifest is complete."""
from __future__ import annotations

import os
import shutil

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from ds_fssdp.runtime.checkpoint.collective import agree, all_gather, attempt, broadcast
from ds_fssdp.runtime.checkpoint.files import (CheckpointError, atomic_write_text, digest, fsync_dir, save_tensors, walk,
                                              write_json)
from ds_fssdp.runtime.checkpoint.layout import (COMMON, FORMAT, LATEST, MANIFEST, META, OLD_PREFIX, TMP_PREFIX, VERSION,
                                               rank_file)
from ds_fssdp.runtime.checkpoint.rng import rng_state


def save(engine, save_dir: str, tag=None, *, client_state=None, save_latest: bool = True,
         exclude_frozen_parameters: bool = False, ds_save) -> bool:
    """``engine.save_checkpoint``: ``ds_save`` is DeepSpeed's own. Collective (every rank calls)."""
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    if engine.checkpoint_engine.is_decoupled() or engine.use_node_local_storage():
        raise CheckpointError("fssdp checkpoints need DeepSpeed's synchronous writer on a shared filesystem "
                              "(checkpoint.writer.decoupled and checkpoint.use_node_local_storage are not supported)")
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    check_tag(tag)
    from ds_fssdp.runtime import checkpoint as package
    stage = engine.fssdp
    if any(s.master.grad is not None for s in stage.shards):
        logger.warning("fssdp: saving a checkpoint in the middle of gradient accumulation: the accumulated "
                       "gradients are not saved (DeepSpeed does not save its own either); save after engine.step()")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp_dir = os.path.join(save_dir, TMP_PREFIX + tag)
    err = None
    if rank == 0:
        err = attempt(lambda: _prepare(save_dir, tmp_dir))
    agree(f"preparing {tmp_dir}", err)
    ds_save(save_dir, TMP_PREFIX + tag, client_state=client_state if client_state is not None else {},
            save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
    # Looked up on the package at call time, so that it can be wrapped (the fault-injection tests do).
    write = package.write_expert_files
    agree(f"writing the expert state into {tmp_dir}", attempt(lambda: write(engine, tmp_dir, tag)))
    files = broadcast(sorted(walk(tmp_dir)) if rank == 0 else None)
    mine = {}
    err = attempt(lambda: mine.update({f: digest(os.path.join(tmp_dir, f))
                                        for i, f in enumerate(files) if i % world == rank}))
    agree(f"hashing the files of {tmp_dir}", err)
    digests = {}
    for part in all_gather(mine):
        digests.update(part)
    err = None
    if rank == 0:
        manifest = {"format": FORMAT, "version": VERSION, "tag": tag, "files": {f: digests[f] for f in files}}
        err = attempt(lambda: (write_json(manifest, os.path.join(tmp_dir, MANIFEST)),
                                _commit(save_dir, tag, tmp_dir, save_latest=save_latest)))
    agree(f"committing checkpoint {tag!r} in {save_dir}", err)
    if rank == 0:
        logger.info(f"fssdp: saved checkpoint {os.path.join(save_dir, tag)} ({len(files)} files)")
    return True


def check_tag(tag: str) -> None:
    if not tag or tag.startswith(".") or "/" in tag or os.sep in tag or tag == LATEST:
        raise ValueError(f"checkpoint tag ({tag!r}) must be a non-empty name without '/', not starting with '.' "
                         f"(reserved for unfinished saves) and not {LATEST!r}")


def write_expert_files(engine, root: str, tag: str) -> None:
    """This rank's expert rows, and on rank 0 the metadata and the shared state."""
    stage = engine.fssdp
    rank = dist.get_rank()
    os.makedirs(os.path.join(root, "fssdp"), exist_ok=True)
    save_tensors(rank_state(stage, engine.device), os.path.join(root, rank_file(rank)))
    if rank == 0:
        save_tensors(common_state(stage), os.path.join(root, COMMON))
        write_json(meta_state(engine, tag), os.path.join(root, META))


def rank_state(stage, device) -> dict:
    """Collective over the EDP group when the expert state is partitioned: every rank runs it."""
    layers = []
    for l, shard in enumerate(stage.shards):
        master, rows, _ = stage.expert_state.full_state(l)
        layers.append({"experts": shard.owned_E.clone(), "master": master.cpu(),
                       "optimizer_rows": {k: v.cpu() for k, v in rows.items()}})
    out = {"format": FORMAT, "version": VERSION, "rank": dist.get_rank(), "layers": layers, "rng": rng_state(device)}
    if stage.edp_size > 1:
        out["layers"] = out["layers"] if stage.group_index == 0 else []  # the first group's files hold every expert
        # Each FSSDP group plans from its own loads and windows.
        out.update(predictor=stage.predictor.state_dict(), window_s=list(stage.window_s))
    return out


def common_state(stage) -> dict:
    opt = stage.optimizer
    scalars, groups = [], []
    if opt is not None:
        for l in range(len(stage.shards)):
            scalars.append({k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                            for k, v in stage.expert_state.scalars(l).items()})
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"format": FORMAT, "version": VERSION, "steps": stage.steps, "predictor": stage.predictor.state_dict(),
            "optimizer_scalars": scalars, "param_groups": groups, "window_s": list(stage.window_s)}


def meta_state(engine, tag: str) -> dict:
    stage = engine.fssdp
    opt = stage.optimizer
    names = {id(m): n for n, m in engine.module.named_modules()}
    layers = []
    for l, (layer, shard) in enumerate(zip(stage.layers, stage.shards)):
        layers.append({"name": names.get(id(layer), ""), "num_experts": layer.num_experts,
                       "activation": layer.spec.activation, "hidden_size": layer.hidden_size,
                       "ffn_hidden_size": layer.ffn_hidden_size, "numel": layer.spec.numel,
                       "spec": layer.spec.describe(), "owner_E": shard.owner_E.tolist(),
                       "optimizer_rows": stage.expert_state.row_keys(l)})
    return {"format": FORMAT, "version": VERSION, "tag": tag, "world_size": stage.world,
            "group_size": stage.group_size,
            "ranks_per_node": stage.topology.ranks_per_node, "policy": stage.config.policy, "steps": stage.steps,
            "global_steps": engine.global_steps, "zero_stage": int(engine.zero_optimization_stage()),
            "compute_dtype": str(stage.shards[0].rows.dtype), "optimizer": type(opt).__name__ if opt else None,
            "layers": layers, "ranks": [rank_file(r) for r in range(stage.world)], "common": COMMON}


def _prepare(save_dir: str, tmp_dir: str) -> None:
    os.makedirs(save_dir, exist_ok=True)
    if os.path.lexists(tmp_dir):
        logger.info(f"fssdp: removing {tmp_dir}, left by an unfinished save")
        shutil.rmtree(tmp_dir)


def _commit(save_dir: str, tag: str, tmp_dir: str, *, save_latest: bool) -> None:
    final = os.path.join(save_dir, tag)
    old = os.path.join(save_dir, OLD_PREFIX + tag)
    if os.path.lexists(final):
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(final, old)  # loading falls back to it until the rename below is done
    os.rename(tmp_dir, final)
    fsync_dir(save_dir)
    if os.path.lexists(old):
        shutil.rmtree(old)
    if save_latest:
        atomic_write_text(os.path.join(save_dir, LATEST), tag)

"""Saving: DeepSpeed's own files plus every expert's rows keyed by (layer, expert), written into
``.tmp-<tag>`` and committed by renames once every rank has written and the manifest is complete;
or, with ``async_save``, staged in host memory now and written and committed in the background
(``staging``, ``background``)."""
from __future__ import annotations

import os
import shutil
from functools import partial

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from ds_fssdp.runtime.checkpoint import background
from ds_fssdp.runtime.checkpoint.collective import agree, agreed, all_gather, broadcast
from ds_fssdp.runtime.checkpoint.files import (CheckpointError, atomic_write_text, deferred_write_errors, digest, fsync_dir,
                                              walk, write_file)
from ds_fssdp.runtime.checkpoint.layout import (COMMON, FORMAT, LATEST, MANIFEST, META, OLD_PREFIX, TMP_PREFIX, VERSION,
                                               rank_file)
from ds_fssdp.runtime.checkpoint.pipeline import every_stage_layers, stages_of
from ds_fssdp.runtime.checkpoint.rng import rng_state
from ds_fssdp.runtime.checkpoint.staging import check_stageable, staging_deepspeed, to_host


def save(engine, save_dir: str, tag=None, *, client_state=None, save_latest: bool = True,
         exclude_frozen_parameters: bool = False, async_save: bool = False, ds_save) -> bool:
    """``engine.save_checkpoint``: ``ds_save`` is DeepSpeed's own. Collective (every rank calls).
    Any pending asynchronous save is waited for first (its error raised on every rank)."""
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    if not isinstance(async_save, bool):
        raise ValueError(f"async_save must be True or False, got {async_save!r}")
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    check_tag(tag)
    wait(engine)
    if engine.checkpoint_engine.is_decoupled() or engine.use_node_local_storage():
        raise CheckpointError("fssdp checkpoints need DeepSpeed's synchronous writer on a shared filesystem "
                              "(checkpoint.writer.decoupled and checkpoint.use_node_local_storage are not supported)")
    if async_save:
        check_stageable(engine)
    from ds_fssdp.runtime import checkpoint as package
    stage = engine.fssdp
    if any(s.master.grad is not None for s in stage.shards):
        logger.warning("fssdp: saving a checkpoint in the middle of gradient accumulation: the accumulated "
                       "gradients are not saved (DeepSpeed does not save its own either); save after engine.step()")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp_dir = os.path.join(save_dir, TMP_PREFIX + tag)
    agreed(f"preparing {tmp_dir}", lambda: _prepare(save_dir, tmp_dir), root_only=True)
    client_state = client_state if client_state is not None else {}
    if async_save:
        _start_async(engine, save_dir, tag, tmp_dir, client_state=client_state, save_latest=save_latest,
                     exclude_frozen_parameters=exclude_frozen_parameters, ds_save=ds_save)
        return True
    with deferred_write_errors(engine) as failed:  # a full disk fails every rank alike
        ds_save(save_dir, TMP_PREFIX + tag, client_state=client_state, save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters)
    agree(f"writing DeepSpeed's files into {tmp_dir}", failed[0] if failed else None)
    # Looked up on the package at call time, so that it can be wrapped (the fault-injection tests do).
    write = package.write_expert_files
    agreed(f"writing the expert state into {tmp_dir}", lambda: write(engine, tmp_dir, tag))
    files = broadcast(sorted(walk(tmp_dir)) if rank == 0 else None)
    mine = {}
    agreed(f"hashing the files of {tmp_dir}",
           lambda: mine.update({f: digest(os.path.join(tmp_dir, f)) for i, f in enumerate(files) if i % world == rank}))
    digests = {f: d for part in all_gather(mine) for f, d in part.items()}
    agreed(f"committing checkpoint {tag!r} in {save_dir}",
           lambda: commit_files(save_dir, tag, tmp_dir, digests, save_latest=save_latest), root_only=True)
    if rank == 0:
        logger.info(f"fssdp: saved checkpoint {os.path.join(save_dir, tag)} ({len(files)} files)")
    return True


def wait(engine) -> None:
    """``engine.wait_for_checkpoint``: collective; see ``background.wait``."""
    background.wait(getattr(engine, "fssdp_checkpoint_writer", None))


def _start_async(engine, save_dir: str, tag: str, tmp_dir: str, *, client_state, save_latest: bool,
                 exclude_frozen_parameters: bool, ds_save) -> None:
    """Stage every file of the checkpoint in host memory (DeepSpeed's collectives and the expert
    state's run here, on every rank), then hand them to this engine's background writer."""
    with staging_deepspeed(engine) as staging:
        ds_save(save_dir, TMP_PREFIX + tag, client_state=client_state, save_latest=False,
                exclude_frozen_parameters=exclude_frozen_parameters)
    files = {}  # file name -> how to write it (given its path), in the background

    def stage():  # DeepSpeed's files by its own writer, as in a synchronous save
        files.update({_inside(tmp_dir, path): partial(staging.real.save, state)
                      for path, state in staging.staged.items()})
        os.makedirs(os.path.join(tmp_dir, "fssdp"), exist_ok=True)
        for name, state in expert_state(engine, tag).items():
            files[name] = partial(write_file, to_host(state))

    agreed(f"staging checkpoint {tag!r}", stage)
    from deepspeed.constants import default_pg_timeout  # DEEPSPEED_TIMEOUT minutes
    timeout = engine.fssdp.config.collective_timeout_s or default_pg_timeout.total_seconds()
    job = background.Job(tag=tag, tmp_dir=tmp_dir, rank=dist.get_rank(), world=dist.get_world_size(),
                         timeout_s=float(timeout), files=files,
                         commit=partial(commit_files, save_dir, tag, tmp_dir, save_latest=save_latest))
    if getattr(engine, "fssdp_checkpoint_writer", None) is None:
        engine.fssdp_checkpoint_writer = background.BackgroundWriter()
    engine.fssdp_checkpoint_writer.start(job)


def _inside(tmp_dir: str, path: str) -> str:
    name = os.path.relpath(path, os.path.abspath(tmp_dir))
    if name.startswith(os.pardir):
        raise CheckpointError(f"DeepSpeed staged {path}, outside the checkpoint's directory {tmp_dir}")
    return name


def commit_files(save_dir: str, tag: str, tmp_dir: str, digests: dict, *, save_latest: bool) -> None:
    """Rank 0, once every file is on disk: the manifest, then the renames (``latest`` last)."""
    manifest = {"format": FORMAT, "version": VERSION, "tag": tag, "files": {f: digests[f] for f in sorted(digests)}}
    write_file(manifest, os.path.join(tmp_dir, MANIFEST))
    _commit(save_dir, tag, tmp_dir, save_latest=save_latest)


def check_tag(tag: str) -> None:
    if not tag or tag.startswith(".") or "/" in tag or os.sep in tag or tag == LATEST:
        raise ValueError(f"checkpoint tag ({tag!r}) must be a non-empty name without '/', not starting with '.' "
                         f"(reserved for unfinished saves) and not {LATEST!r}")


def write_expert_files(engine, root: str, tag: str) -> None:
    """This rank's expert rows, and on rank 0 the metadata and the shared state."""
    os.makedirs(os.path.join(root, "fssdp"), exist_ok=True)
    for name, state in expert_state(engine, tag).items():
        write_file(state, os.path.join(root, name))


def expert_state(engine, tag: str) -> dict:
    """File name -> state: this rank's rows; on rank 0 also the shared state and the metadata
    (JSON). Collective when the expert state is partitioned (``rank_state``) and under pipeline
    parallelism (every stage's layers go into the metadata: ``checkpoint/pipeline.py``)."""
    stage = engine.fssdp
    rank = dist.get_rank()
    layers = layer_meta(engine)
    if stage.layout is not None:
        layers = every_stage_layers(stage, layers)
    out = {rank_file(rank): rank_state(stage, engine.device)}
    if rank == 0:
        out[COMMON] = common_state(stage)
        out[META] = meta_state(engine, tag, layers=layers)
    return out


def rank_state(stage, device) -> dict:
    """Collective over the EDP group when the expert state is partitioned: every rank runs it."""
    layers = []
    for l, shard in enumerate(stage.shards):
        master, rows, _ = stage.expert_state.full_state(l)
        layers.append({"experts": shard.owned_E.clone(), "master": master.cpu(),
                       "optimizer_rows": {k: v.cpu() for k, v in rows.items()}})
    out = {"format": FORMAT, "version": VERSION, "rank": dist.get_rank(),  # the first group's files: every expert
           "layers": layers if stage.edp_size == 1 or stage.group_index == 0 else [], "rng": rng_state(device)}
    if stage.edp_size > 1 or stage.layout is not None:
        # Each FSSDP group (and each pipeline stage) plans from its own loads and windows.
        out.update(predictor=stage.predictor.state_dict(), window_s=list(stage.window_s),
                   attention_s=list(stage.attention_s))
    if stage.layout is not None:  # each stage steps its own layers
        out["optimizer_scalars"] = _scalars(stage)
    return out


def _scalars(stage) -> list:
    """The expert optimizer's per-layer scalar state (Adam's step), per layer of the stage."""
    if stage.optimizer is None:
        return []
    copy = lambda v: v.detach().cpu().clone() if torch.is_tensor(v) else v
    return [{k: copy(v) for k, v in stage.expert_state.scalars(l).items()} for l in range(len(stage.shards))]


def common_state(stage) -> dict:
    opt = stage.optimizer
    scalars, groups = _scalars(stage), []
    if opt is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"format": FORMAT, "version": VERSION, "steps": stage.steps, "predictor": stage.predictor.state_dict(),
            "optimizer_scalars": scalars, "param_groups": groups, "window_s": list(stage.window_s),
            "attention_s": list(stage.attention_s)}


def layer_meta(engine) -> list:
    """This rank's layers' descriptions for the metadata."""
    stage = engine.fssdp
    names = {id(m): n for n, m in engine.module.named_modules()}
    return [{"name": names.get(id(layer), ""), "num_experts": layer.num_experts, "activation": layer.spec.activation,
             "hidden_size": layer.hidden_size, "ffn_hidden_size": layer.ffn_hidden_size, "numel": layer.spec.numel,
             "spec": layer.spec.describe(), "owner_E": shard.owner_E.tolist(),
             "optimizer_rows": stage.expert_state.row_keys(l), "dtype": str(shard.rows.dtype)}
            for l, (layer, shard) in enumerate(zip(stage.layers, stage.shards))]


def meta_state(engine, tag: str, *, layers: list | None = None) -> dict:
    """The metadata; ``layers``: every layer's description (default: this rank's, :func:`layer_meta`)."""
    stage = engine.fssdp
    opt = stage.optimizer
    layers = layer_meta(engine) if layers is None else layers
    world = dist.get_world_size()
    out = {"format": FORMAT, "version": VERSION, "tag": tag, "world_size": world, "group_size": stage.group_size,
           "ranks_per_node": stage.topology.ranks_per_node, "policy": stage.config.policy, "steps": stage.steps,
           "global_steps": engine.global_steps, "zero_stage": int(engine.zero_optimization_stage()),
           "compute_dtype": layers[0]["dtype"] if layers else None, "optimizer": type(opt).__name__ if opt else None,
           "layers": layers, "ranks": [rank_file(r) for r in range(world)], "common": COMMON}
    if stage.layout is not None:
        out.update(pipeline_stages=stages_of(stage), dp_size=stage.world)
    return out


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

"""Checkpoints of an FSSDP engine: DeepSpeed's dense state plus every expert's state keyed by
(layer, expert), never by rank; written atomically, loaded safely, under any owners and world size.

Legend: L MoE layers, E experts, D ranks, S rows a rank owns, P elements per expert.

Layout of ``<save_dir>/<tag>/`` (format ``ds_fssdp.checkpoint`` version 1):

    mp_rank_00_model_states.pt         DeepSpeed: dense module, dense optimizer (ZeRO 0), LR
                                       scheduler, global/skipped steps, the client state
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   DeepSpeed: ZeRO 1/2 dense optimizer partitions
    fssdp/meta.json                    world size, ranks per node, the expert optimizer's type, per
                                       layer: module name, expert shape, num_experts, owner_E (JSON)
    fssdp/common.pt                    rank 0: stage step, predictor windows, the expert optimizer's
                                       hyperparameters and per-layer scalar state (Adam's step)
    fssdp/rankRRRRR.pt                 rank R: per layer the expert ids it owned (ascending), their
                                       fp32 master rows [S, P] and optimizer rows [S, P] (Adam's
                                       exp_avg / exp_avg_sq, SGD's momentum_buffer); its RNG states.
                                       With FSSDP groups only the first group's ranks hold layers
                                       (every group owns the same experts; state partitioned over
                                       the EDP group is gathered into full rows first), and every
                                       rank its group's predictor windows
    manifest.json                      bytes and sha256 of every file above (written last)

In bf16/fp16 the compute rows are the master rows cast (the engine keeps them so after every
step), so only the fp32 masters are stored; in fp32 the rows are the masters.

Atomic save: everything is written into ``<save_dir>/.tmp-<tag>``; once every rank has written
and the manifest is complete, rank 0 renames the directory to ``<tag>`` (a previous ``<tag>`` is
moved to ``.old-<tag>`` first and deleted after) and then replaces ``latest`` by an atomic
rename. A save interrupted at any point leaves ``latest`` and the checkpoint it names untouched.
``save_dir`` must be a filesystem every rank sees (as DeepSpeed assumes).

Safe load: every file is checked against the manifest (size always, sha256 with ``verify``),
spread over the ranks, before anything is read into the engine; any bad file fails every rank
with its name. Every ``.pt`` file, DeepSpeed's included, is read with ``weights_only=True``
(DeepSpeed's own loader uses ``weights_only=False``), so loading never runs pickled code; the
few DeepSpeed data classes its ZeRO files hold are allow-listed by name.

Owners after a load: the saved owners when the world size, ``ranks_per_node`` and the group size
are the same (exact resume, also after a re-shard); otherwise the homogeneous owners of the new
FSSDP group (the
next re-shard, if configured, re-plans them). Each rank reads the rows of the experts it owns
from whichever files hold them. The predictor's windows are kept; on another world size each
window keeps its per-expert totals (the per-rank split no longer applies). RNG states are
restored per rank when the world size is the same.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as tdist
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.planner import homogeneous_owner

FORMAT = "ds_fssdp.checkpoint"
VERSION = 1
META = "fssdp/meta.json"
COMMON = "fssdp/common.pt"
MANIFEST = "manifest.json"
DS_MODEL_STATES = "mp_rank_00_model_states.pt"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file."""


def rank_file(rank: int) -> str:
    return f"fssdp/rank{rank:05d}.pt"


# -- save --------------------------------------------------------------------------------------
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
    stage = engine.fssdp
    if any(s.master.grad is not None for s in stage.shards):
        logger.warning("fssdp: saving a checkpoint in the middle of gradient accumulation: the accumulated "
                       "gradients are not saved (DeepSpeed does not save its own either); save after engine.step()")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp_dir = os.path.join(save_dir, TMP_PREFIX + tag)
    err = None
    if rank == 0:
        err = _attempt(lambda: _prepare(save_dir, tmp_dir))
    _agree(f"preparing {tmp_dir}", err)
    ds_save(save_dir, TMP_PREFIX + tag, client_state=client_state if client_state is not None else {},
            save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
    _agree(f"writing the expert state into {tmp_dir}", _attempt(lambda: write_expert_files(engine, tmp_dir, tag)))
    files = _broadcast(sorted(_walk(tmp_dir)) if rank == 0 else None)
    mine = {}
    err = _attempt(lambda: mine.update({f: _digest(os.path.join(tmp_dir, f))
                                        for i, f in enumerate(files) if i % world == rank}))
    _agree(f"hashing the files of {tmp_dir}", err)
    digests = {}
    for part in _all_gather(mine):
        digests.update(part)
    err = None
    if rank == 0:
        manifest = {"format": FORMAT, "version": VERSION, "tag": tag, "files": {f: digests[f] for f in files}}
        err = _attempt(lambda: (_write_json(manifest, os.path.join(tmp_dir, MANIFEST)),
                                _commit(save_dir, tag, tmp_dir, save_latest=save_latest)))
    _agree(f"committing checkpoint {tag!r} in {save_dir}", err)
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
    # Collective over the EDP group when the expert state is partitioned: every rank runs it.
    _save_tensors(rank_state(stage, engine.device), os.path.join(root, rank_file(rank)))
    if rank == 0:
        _save_tensors(common_state(stage), os.path.join(root, COMMON))
        _write_json(meta_state(engine, tag), os.path.join(root, META))


def rank_state(stage, device) -> dict:
    layers = []
    for l, shard in enumerate(stage.shards):
        master, rows, _ = stage.expert_state.full_state(l)
        layers.append({"experts": shard.owned_E.clone(), "master": master.cpu(),
                       "optimizer_rows": {k: v.cpu() for k, v in rows.items()}})
    out = {"format": FORMAT, "version": VERSION, "rank": dist.get_rank(), "layers": layers, "rng": rng_state(device)}
    if stage.edp_size > 1:
        out["layers"] = out["layers"] if stage.group_index == 0 else []  # the first group's files hold every expert
        # Each FSSDP group plans from its own loads and windows.
        out.update(predictor=stage.predictor.state_dict(), window_s=[s.window_s for s in stage.shards])
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
            "optimizer_scalars": scalars, "param_groups": groups, "window_s": [s.window_s for s in stage.shards]}


def meta_state(engine, tag: str) -> dict:
    stage = engine.fssdp
    opt = stage.optimizer
    names = {id(m): n for n, m in engine.module.named_modules()}
    layers = []
    for l, (layer, shard) in enumerate(zip(stage.layers, stage.shards)):
        layers.append({"name": names.get(id(layer), ""), "num_experts": layer.num_experts,
                       "activation": layer.spec.activation, "hidden_size": layer.hidden_size,
                       "ffn_hidden_size": layer.ffn_hidden_size, "numel": layer.spec.numel,
                       "owner_E": shard.owner_E.tolist(),
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
    _fsync_dir(save_dir)
    if os.path.lexists(old):
        shutil.rmtree(old)
    if save_latest:
        _atomic_write_text(os.path.join(save_dir, LATEST), tag)


# -- load --------------------------------------------------------------------------------------
def load(engine, load_dir: str, tag=None, *, ds_load, load_module_strict=True, load_optimizer_states=True,
         load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None,
         load_expert_optimizer_states=None, verify=True):
    """``engine.load_checkpoint``: ``ds_load`` is DeepSpeed's own. Collective. Returns DeepSpeed's
    ``(load_path, client_state)``, or ``(None, None)`` when there is no ``latest`` (as DeepSpeed)."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            logger.warning(f"fssdp: no {latest}; nothing loaded (pass a tag to load a specific checkpoint)")
            return None, None
        tag = _read_text(latest).strip()
    dir_tag = resolve_tag(load_dir, str(tag))
    root = os.path.join(load_dir, dir_tag)
    manifest, meta = read_manifest(root), read_meta(root)
    verify_files(root, manifest, digests=verify, group_ranks=True)
    dense_opt = load_optimizer_states and not load_module_only
    expert_opt = (dense_opt if load_expert_optimizer_states is None else load_expert_optimizer_states)
    expert_opt = bool(expert_opt) and not load_module_only
    check_compatible(engine, meta, root, dense_optimizer=dense_opt, expert_optimizer=expert_opt)
    with safe_deepspeed_loading(engine):
        load_path, client_state = ds_load(load_dir, dir_tag, load_module_strict=load_module_strict,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states,
                                          load_module_only=load_module_only, custom_load_fn=custom_load_fn)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed loaded nothing from {root}")
    err = _attempt(lambda: load_expert_state(engine, root, meta, optimizer=expert_opt,
                                             full_state=not load_module_only))
    _agree(f"loading the expert state of {root}", err)
    if dist.get_rank() == 0:
        logger.info(f"fssdp: loaded checkpoint {root} (saved on {meta['world_size']} ranks, loaded on "
                    f"{engine.fssdp.world})")
    return load_path, client_state


def resolve_tag(load_dir: str, tag: str) -> str:
    """The directory holding ``tag``: itself, or ``.old-<tag>`` if a save of the same tag stopped
    between its two renames."""
    if os.path.isdir(os.path.join(load_dir, tag)):
        return tag
    if os.path.isdir(os.path.join(load_dir, OLD_PREFIX + tag)):
        logger.warning(f"fssdp: {os.path.join(load_dir, tag)} is missing (a save of the same tag was interrupted); "
                       f"loading the previous copy {OLD_PREFIX + tag}")
        return OLD_PREFIX + tag
    raise CheckpointError(f"no checkpoint {tag!r} in {load_dir} ({os.path.join(load_dir, tag)} does not exist)")


def read_manifest(root: str) -> dict:
    manifest = _read_json(os.path.join(root, MANIFEST))
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{os.path.join(root, MANIFEST)} is not a {FORMAT} manifest (is {root} a ds_fssdp "
                              "checkpoint, saved completely?)")
    return manifest


def read_meta(root: str) -> dict:
    path = os.path.join(root, META)
    meta = _read_json(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not {FORMAT} metadata")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has format version {meta.get('version')}; this ds_fssdp reads up to {VERSION}")
    return meta


def verify_files(root: str, manifest: dict, *, digests: bool = True, group_ranks: bool = False) -> None:
    """Every file of the manifest exists with its size (all ranks) and, with ``digests``, its
    sha256 (each rank hashes a share). ``group_ranks``: collective, every rank raises the same."""
    names = sorted(manifest["files"])
    rank, world = (dist.get_rank(), dist.get_world_size()) if group_ranks else (0, 1)
    errors = []
    for i, name in enumerate(names):
        path, want = os.path.join(root, name), manifest["files"][name]
        if not os.path.isfile(path):
            errors.append(f"checkpoint file {path} is missing")
            continue
        size = os.path.getsize(path)
        if size != want["bytes"]:
            errors.append(f"checkpoint file {path} has {size} bytes, the manifest says {want['bytes']} (truncated?)")
        elif digests and i % world == rank:
            got = _digest(path, fsync=False)["sha256"]
            if got != want["sha256"]:
                errors.append(f"checkpoint file {path} is corrupted: sha256 {got}, the manifest says {want['sha256']}")
    if group_ranks:
        errors = sorted({e for part in _all_gather(errors) for e in part})
    if errors:
        raise CheckpointError("; ".join(errors))


def check_compatible(engine, meta: dict, root: str, *, dense_optimizer: bool, expert_optimizer: bool) -> None:
    """Refuse (on every rank alike) a checkpoint that does not fit the engine."""
    stage = engine.fssdp
    path = os.path.join(root, META)
    if len(meta["layers"]) != len(stage.layers):
        raise CheckpointError(f"{path}: {len(meta['layers'])} MoE layers saved, the model has {len(stage.layers)}")
    for i, (saved, layer) in enumerate(zip(meta["layers"], stage.layers)):
        mine = {"num_experts": layer.num_experts, "activation": layer.spec.activation,
                "hidden_size": layer.hidden_size, "ffn_hidden_size": layer.ffn_hidden_size}
        diff = {k: (saved[k], v) for k, v in mine.items() if saved[k] != v}
        if diff:
            raise CheckpointError(f"{path}: MoE layer {i} ({saved['name']}) differs (saved, model): {diff}")
    if dense_optimizer and engine.zero_optimization() and meta["world_size"] != stage.world:
        raise CheckpointError(
            f"{root} was saved on {meta['world_size']} ranks with ZeRO stage {meta['zero_stage']}; DeepSpeed cannot "
            f"re-partition its dense optimizer state for {stage.world} ranks. Load with load_optimizer_states=False "
            "and load_expert_optimizer_states=True (dense moments start fresh, every expert's moments load), or "
            "convert the dense part with DeepSpeed's universal checkpoint")
    opt = stage.optimizer
    if expert_optimizer and opt is not None and meta["optimizer"] not in (None, type(opt).__name__):
        raise CheckpointError(f"{path}: the expert optimizer state was saved by {meta['optimizer']}, the engine uses "
                              f"{type(opt).__name__}; load with load_expert_optimizer_states=False")


def load_expert_state(engine, root: str, meta: dict, *, optimizer: bool, full_state: bool) -> None:
    """Every layer: the rows of the experts this rank owns under the (possibly new) owners, their
    optimizer state; then the stage step, predictor windows and RNG states (``full_state``)."""
    stage = engine.fssdp
    rank, world = dist.get_rank(), stage.world
    same_world = meta["world_size"] == world
    same_groups = same_world and meta.get("group_size", meta["world_size"]) == stage.group_size
    same_owners = same_groups and meta["ranks_per_node"] == stage.topology.ranks_per_node
    files = _RankFiles(root)
    common = load_file(os.path.join(root, COMMON)) if (optimizer or full_state) else None
    opt = stage.optimizer
    if optimizer and opt is not None and common["param_groups"]:
        for group, saved in zip(opt.param_groups, common["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
    for l, (shard, saved) in enumerate(zip(stage.shards, meta["layers"])):
        saved_owner_E = torch.tensor(saved["owner_E"], dtype=torch.long)
        owner_E = saved_owner_E.clone() if same_owners else homogeneous_owner(saved["num_experts"], stage.group_size)
        need_E = torch.nonzero(owner_E == shard.rank).flatten()
        keys = saved["optimizer_rows"] if optimizer and opt is not None else []
        master_SP, rows = _gather_rows(files, l, saved_owner_E=saved_owner_E, need_E=need_E, numel=saved["numel"],
                                       keys=keys)
        scalars = None
        if optimizer and opt is not None:
            param = stage.masters()[l]
            group = next(g for g in opt.param_groups if any(p is param for p in g["params"]))
            scalars = {k: _scalar_to(v, shard.rows.device, group) for k, v in common["optimizer_scalars"][l].items()}
        # Re-sliced over the EDP group when the expert state is partitioned.
        stage.expert_state.set_state(l, owner_E=owner_E, master_SP=master_SP,
                                     rows=rows if scalars is not None else None, scalars=scalars)
    if full_state:
        stage.steps = int(common["steps"])
        planning = files[rank] if same_groups and "predictor" in files[rank] else common  # this group's own
        stage.predictor.load_state_dict(_predictor_for(planning["predictor"], same_groups))
        for shard, w in zip(stage.shards, planning["window_s"]):
            shard.window_s = w
        if same_world:
            set_rng_state(files[rank]["rng"], engine.device)
        elif rank == 0:
            logger.info(f"fssdp: RNG states not restored (saved on {meta['world_size']} ranks, loading on {world})")


def _gather_rows(files, layer: int, *, saved_owner_E, need_E, numel: int, keys) -> tuple:
    """Rows [S, P] of the experts ``need_E`` (ascending) and their optimizer rows by key."""
    master_SP = torch.empty(need_E.numel(), numel, dtype=torch.float32)
    rows = {k: torch.empty(need_E.numel(), numel, dtype=torch.float32) for k in keys}
    src_S = saved_owner_E[need_E]
    for src in torch.unique(src_S).tolist():
        sel = torch.nonzero(src_S == src).flatten()
        saved = files[src]["layers"][layer]
        expect_E = torch.nonzero(saved_owner_E == src).flatten()
        if not torch.equal(saved["experts"], expect_E) or saved["master"].shape != (expect_E.numel(), numel):
            raise CheckpointError(f"{files.path(src)}: layer {layer} holds experts {saved['experts'].tolist()} "
                                  f"({tuple(saved['master'].shape)}), {META} says {expect_E.tolist()}")
        pos = torch.searchsorted(expect_E, need_E[sel])
        master_SP[sel] = saved["master"].index_select(0, pos).float()
        for k in keys:
            if k not in saved["optimizer_rows"]:
                raise CheckpointError(f"{files.path(src)}: layer {layer} lacks optimizer state {k!r}")
            rows[k][sel] = saved["optimizer_rows"][k].index_select(0, pos).to(rows[k].dtype)
    return master_SP, rows


def _scalar_to(value, device, group: dict):
    """As torch's Optimizer.load_state_dict: ``step`` stays on the CPU unless capturable/fused."""
    if not torch.is_tensor(value):
        return value
    if group.get("capturable") or group.get("fused"):
        return value.clone().to(device)
    return value.clone()


def _predictor_for(state: dict, same_world: bool) -> dict:
    if same_world:
        return state
    # Per-rank token counts of another world say nothing about this one; the per-expert totals do.
    return {"window": state["window"],
            "history": [[h.sum(1, keepdim=True) if h.dim() == 2 else h for h in hist] for hist in state["history"]]}


class _RankFiles:
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


# -- consolidated export (offline, one process) -------------------------------------------------
def consolidated_state_dict(load_dir: str, tag=None, *, verify: bool = True) -> dict:
    """The unsharded model's state dict from a checkpoint, in one process without any rank running:
    DeepSpeed's dense module weights plus every expert tensor ([E, ...], fp32) under its module
    name (``blocks.0.moe.w_a``): ``model.load_state_dict`` of the same model before
    ``ds_fssdp.initialize``, for inference or export."""
    if tag is None:
        tag = _read_text(os.path.join(load_dir, LATEST)).strip()
    root = os.path.join(load_dir, resolve_tag(load_dir, str(tag)))
    manifest, meta = read_manifest(root), read_meta(root)
    verify_files(root, manifest, digests=verify)
    out = dict(load_file(os.path.join(root, DS_MODEL_STATES))["module"])
    files = _RankFiles(root)
    for l, saved in enumerate(meta["layers"]):
        spec = ExpertSpec(saved["activation"], saved["hidden_size"], saved["ffn_hidden_size"])
        owner_E = torch.tensor(saved["owner_E"], dtype=torch.long)
        full_EP, _ = _gather_rows(files, l, saved_owner_E=owner_E, need_E=torch.arange(owner_E.numel()),
                                  numel=saved["numel"], keys=[])
        prefix = f"{saved['name']}." if saved["name"] else ""
        for name, tensor in spec.views(full_EP).items():
            out[prefix + name] = tensor.contiguous()
    return out


def export_consolidated(load_dir: str, out_path: str, tag=None) -> str:
    """Write :func:`consolidated_state_dict` to ``out_path`` (safetensors for ``*.safetensors``,
    else ``torch.save``), atomically."""
    state = {k: v.detach().cpu().contiguous() for k, v in consolidated_state_dict(load_dir, tag).items()}
    tmp = out_path + ".tmp"
    if out_path.endswith(".safetensors"):
        from safetensors.torch import save_file
        save_file(state, tmp)
    else:
        torch.save(state, tmp)
    os.replace(tmp, out_path)
    return out_path


# -- safe reading --------------------------------------------------------------------------------
def load_file(path: str, *, map_location="cpu", mmap: bool = False):
    """``torch.load`` with ``weights_only=True`` (plus DeepSpeed's plain data classes); any failure
    is a :class:`CheckpointError` naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        with _allowed(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint file {path} was refused by the safe loader (weights_only=True: it holds "
                              f"objects whose unpickling could run code): {_first_line(err)}") from err
    except Exception as err:  # torch reports truncation and corruption with several types
        raise CheckpointError(f"checkpoint file {path} cannot be read (truncated or corrupted?): "
                              f"{type(err).__name__}: {_first_line(err)}") from err


@contextmanager
def safe_deepspeed_loading(engine):
    """DeepSpeed's checkpoint engine reads with :func:`load_file` while this is active."""
    ce = engine.checkpoint_engine
    ce.load = lambda path, map_location=None: load_file(path, map_location=map_location)
    try:
        yield
    finally:
        del ce.load


def _allowed(classes: list):
    if hasattr(torch.serialization, "safe_globals"):
        return torch.serialization.safe_globals(classes)
    torch.serialization.add_safe_globals(classes)  # torch 2.4: a process-wide allow-list
    return nullcontext()


def _deepspeed_safe_globals() -> list:
    """Classes DeepSpeed's ZeRO checkpoints pickle: plain data (a dataclass, an enum, loss scalers)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [fragment_address, ZeroStageEnum, LossScaler, DynamicLossScaler]


def _first_line(err) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# -- RNG -----------------------------------------------------------------------------------------
def rng_state(device) -> dict:
    np_name, np_keys, np_pos, np_gauss, np_cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_gauss),
                       float(np_cached))}
    if torch.device(device).type != "cpu":
        state["accelerator"] = get_accelerator().get_rng_state()
    return state


def set_rng_state(state: dict, device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, gauss, cached))
    if "accelerator" in state and torch.device(device).type != "cpu":
        get_accelerator().set_rng_state(state["accelerator"])


# -- files and agreement -------------------------------------------------------------------------
def _save_tensors(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read (truncated or corrupted?): {err}") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint file {path} does not hold a JSON object")
    return value


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _walk(root: str) -> list:
    return [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]


def _digest(path: str, *, fsync: bool = True) -> dict:
    """Size and sha256; ``fsync``: also flush the file to disk (DeepSpeed's writer does not)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def _attempt(fn):
    """Run ``fn``; return None, or the exception it raised (to be agreed on by all ranks)."""
    try:
        fn()
    except Exception as err:  # re-raised on every rank by _agree
        return err
    return None


def _agree(what: str, err) -> None:
    """Every rank learns whether any failed and then raises alike (no rank is left waiting in a
    later collective)."""
    messages = _all_gather(None if err is None else f"{type(err).__name__}: {err}")
    failed = {r: m for r, m in enumerate(messages) if m is not None}
    if failed:
        text = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {text}") from err


def _all_gather(obj) -> list:
    out = [None] * dist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]

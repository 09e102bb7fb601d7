"""Loading: check every file against the manifest, refuse what does not fit the engine, let
DeepSpeed load its dense part (through the safe reader), then place every expert's rows on its
owner under this engine's world size."""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.runtime.checkpoint.collective import agreed
from ds_fssdp.runtime.checkpoint.files import CheckpointError, load_file, read_text, safe_deepspeed_loading
from ds_fssdp.runtime.checkpoint.layout import COMMON, LATEST, META, read_manifest, read_meta, resolve_tag, verify_files
from ds_fssdp.runtime.checkpoint.pipeline import check_stages, saved_place
from ds_fssdp.runtime.checkpoint.reshape import RankFiles, gather_rows, owners_after_load, predictor_for, same_groups
from ds_fssdp.runtime.checkpoint.rng import set_rng_state
from ds_fssdp.runtime.checkpoint.universal import check_convertible, convert, loading_universal, needs_universal


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
        tag = read_text(latest).strip()
    dir_tag = resolve_tag(load_dir, str(tag))
    root = os.path.join(load_dir, dir_tag)
    manifest, meta = read_manifest(root), read_meta(root)
    verify_files(root, manifest, digests=verify, group_ranks=True)
    dense_opt = load_optimizer_states and not load_module_only
    expert_opt = (dense_opt if load_expert_optimizer_states is None else load_expert_optimizer_states)
    expert_opt = bool(expert_opt) and not load_module_only
    check_stages(engine.fssdp, meta, root)
    check_zero_stage(engine, meta, root, dense_optimizer=dense_opt)
    if engine.fssdp.layout is None:
        check_compatible(engine, meta, root, expert_optimizer=expert_opt)
    else:  # each stage checks its own layers: every rank refuses alike
        agreed(f"checking {root}", lambda: check_compatible(engine, meta, root, expert_optimizer=expert_opt))
    ds_dir, ds_tag, universal = load_dir, dir_tag, nullcontext()
    if needs_universal(engine, meta, dense_optimizer=dense_opt):
        check_convertible(meta, root, dist.get_world_size())
        (ds_dir, ds_tag), universal = convert(load_dir, dir_tag, manifest), loading_universal(engine)
    with safe_deepspeed_loading(engine), universal:
        load_path, client_state = ds_load(ds_dir, ds_tag, load_module_strict=load_module_strict,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states,
                                          load_module_only=load_module_only, custom_load_fn=custom_load_fn)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed loaded nothing from {root}")
    agreed(f"loading the expert state of {root}",
           lambda: load_expert_state(engine, root, meta, optimizer=expert_opt, full_state=not load_module_only))
    if dist.get_rank() == 0:
        logger.info(f"fssdp: loaded checkpoint {root} (saved on {meta['world_size']} ranks, loaded on "
                    f"{dist.get_world_size()})")
    return load_path, client_state


def check_zero_stage(engine, meta: dict, root: str, *, dense_optimizer: bool) -> None:
    """DeepSpeed keeps the dense optimizer state whole in its model files at ZeRO 0 and in per-rank
    partitions at ZeRO >= 1, and reads only its own stage's kind (a ZeRO 0 checkpoint in a ZeRO 1
    engine: files missing; the universal conversion needs the partitions): refused by name."""
    saved, mine = int(meta.get("zero_stage", 0)), int(engine.zero_optimization_stage())
    if dense_optimizer and (saved == 0) != (mine == 0):
        raise CheckpointError(f"{os.path.join(root, META)}: saved at zero_optimization.stage {saved}, this engine runs "
                              f"stage {mine}: DeepSpeed keeps the dense optimizer state whole at stage 0 and partitioned "
                              "above, and loads only its own kind; resume at stage "
                              f"{saved}, or load with load_optimizer_states=False (the dense optimizer state starts "
                              "fresh)")


def check_compatible(engine, meta: dict, root: str, *, expert_optimizer: bool) -> None:
    """Refuse (on every rank alike) a checkpoint that does not fit the engine."""
    stage = engine.fssdp
    path = os.path.join(root, META)
    if len(meta["layers"]) != stage.num_global_layers:
        raise CheckpointError(f"{path}: {len(meta['layers'])} MoE layers saved, the model has "
                              f"{stage.num_global_layers}")
    for i, layer in zip(stage.global_layers, stage.layers):  # by global index (pipeline stages hold some)
        saved = meta["layers"][i]
        mine = {"num_experts": layer.num_experts, "activation": layer.spec.activation,
                "hidden_size": layer.hidden_size, "ffn_hidden_size": layer.ffn_hidden_size}
        diff = {k: (saved[k], v) for k, v in mine.items() if saved[k] != v}
        saved_spec = ExpertSpec.from_description(saved.get("spec") or saved)  # older checkpoints: no "spec"
        if saved_spec.describe() != layer.spec.describe():
            diff["spec"] = (saved_spec.describe(), layer.spec.describe())
        if diff:
            raise CheckpointError(f"{path}: MoE layer {i} ({saved['name']}) differs (saved, model): {diff}")
    opt = stage.optimizer
    if expert_optimizer and opt is not None and meta["optimizer"] not in (None, type(opt).__name__):
        raise CheckpointError(f"{path}: the expert optimizer state was saved by {meta['optimizer']}, the engine uses "
                              f"{type(opt).__name__}; load with load_expert_optimizer_states=False")


def load_expert_state(engine, root: str, meta: dict, *, optimizer: bool, full_state: bool) -> None:
    """Every layer: the rows of the experts this rank owns under the (possibly new) owners, their
    optimizer state; then the stage step, predictor windows and RNG states (``full_state``)."""
    stage = engine.fssdp
    rank, world = dist.get_rank(), stage.world  # the data-parallel ranks (the world without pipelining)
    same_world = meta["world_size"] == dist.get_world_size()
    files = RankFiles(root)
    common = load_file(os.path.join(root, COMMON)) if (optimizer or full_state) else None
    opt = stage.optimizer
    if optimizer and opt is not None and common["param_groups"]:
        for group, saved in zip(opt.param_groups, common["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
    for l, (shard, g) in enumerate(zip(stage.shards, stage.global_layers)):
        saved, (base, local) = meta["layers"][g], saved_place(meta, g)
        saved_owner_E = torch.tensor(saved["owner_E"], dtype=torch.long)
        owner_E = owners_after_load(meta, saved_owner_E, world=world, group_size=stage.group_size,
                                    ranks_per_node=stage.topology.ranks_per_node)
        need_E = torch.nonzero(owner_E == shard.rank).flatten()
        keys = saved["optimizer_rows"] if optimizer and opt is not None else []
        master_SP, rows = gather_rows(files, local, saved_owner_E=saved_owner_E, need_E=need_E, numel=saved["numel"],
                                      keys=keys, base=base)
        scalars = None
        param = stage.masters()[l]
        group = next((g for g in opt.param_groups if any(p is param for p in g["params"])), None) if opt else None
        if optimizer and group is not None:  # None: frozen experts, in no optimizer
            # each pipeline stage's scalars are in its files
            saved_scalars = files[base]["optimizer_scalars"][local] if stage.layout else common["optimizer_scalars"][l]
            scalars = {k: _scalar_to(v, shard.rows.device, group) for k, v in saved_scalars.items()}
        # Re-sliced over the EDP group when the expert state is partitioned.
        stage.expert_state.set_state(l, owner_E=owner_E, master_SP=master_SP,
                                     rows=rows if scalars is not None else None, scalars=scalars)
    if full_state:
        same = same_groups(meta, world=world, group_size=stage.group_size)
        planning = files[rank] if same and "predictor" in files[rank] else common  # this group's own
        if stage.layout is not None and not same:  # the stage's: from its first rank's file
            planning = files[saved_place(meta, stage.global_layers[0])[0]] if stage.layers else None
        stage.restore(int(common["steps"]), planning=None if planning is None else dict(
            planning, predictor=predictor_for(planning["predictor"], same)))
        if same_world:
            set_rng_state(files[rank]["rng"], engine.device)
        elif rank == 0:
            logger.info(f"fssdp: RNG states not restored (saved on {meta['world_size']} ranks, loading on {world})")


def _scalar_to(value, device, group: dict):
    """As torch's Optimizer.load_state_dict: ``step`` stays on the CPU unless capturable/fused."""
    if not torch.is_tensor(value):
        return value
    return value.clone().to(device) if group.get("capturable") or group.get("fused") else value.clone()

"""Consolidated export (offline, one process): the unsharded model's state dict from a checkpoint."""
from __future__ import annotations

import os

import torch

from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.runtime.checkpoint.files import CheckpointError, load_file, read_text
from ds_fssdp.runtime.checkpoint.layout import (DS_MODEL_STATES, LATEST, read_manifest, read_meta, resolve_tag,
                                               verify_files)
from ds_fssdp.runtime.checkpoint.reshape import RankFiles, gather_rows


def consolidated_state_dict(load_dir: str, tag=None, *, verify: bool = True) -> dict:
    """The unsharded model's state dict from a checkpoint, in one process without any rank running:
    DeepSpeed's dense module weights plus every expert tensor ([E, ...], fp32) under its module
    name (``blocks.0.moe.w_a``): ``model.load_state_dict`` of the same model before
    ``ds_fssdp.initialize``, for inference or export."""
    root, meta = open_checkpoint(load_dir, tag, verify=verify)
    if int(meta.get("pipeline_stages", 1)) > 1:
        raise CheckpointError(f"{root} was saved with {meta['pipeline_stages']} pipeline stages: the consolidated "
                              "export reads a checkpoint without pipelining (DeepSpeed keeps a pipeline's dense "
                              "weights per layer file, under the stage's module names)")
    out = dense_state_dict(load_dir, os.path.basename(root), meta)
    files = RankFiles(root)
    for l, saved in enumerate(meta["layers"]):
        spec = ExpertSpec.from_description(saved.get("spec") or saved)  # older checkpoints: no "spec"
        prefix = f"{saved['name']}." if saved["name"] else ""
        for name, tensor in spec.views(all_rows(files, l, saved)).items():
            out[prefix + name] = tensor.contiguous()
    return out


def open_checkpoint(load_dir: str, tag=None, *, verify: bool = True) -> tuple:
    """``(root, meta)`` of checkpoint ``tag`` (default: ``latest``) of ``load_dir``, its files checked
    against the manifest."""
    if tag is None:
        tag = read_text(os.path.join(load_dir, LATEST)).strip()
    root = os.path.join(load_dir, resolve_tag(load_dir, str(tag)))
    verify_files(root, read_manifest(root), digests=verify)
    return root, read_meta(root)


def all_rows(files: RankFiles, l: int, saved: dict) -> torch.Tensor:
    """Every expert's fp32 master row [E, P] of saved layer ``l`` (``saved``: its metadata)."""
    owner_E = torch.tensor(saved["owner_E"], dtype=torch.long)
    return gather_rows(files, l, saved_owner_E=owner_E, need_E=torch.arange(owner_E.numel()),
                       numel=saved["numel"], keys=[])[0]


def dense_state_dict(load_dir: str, dir_tag: str, meta: dict) -> dict:
    """DeepSpeed's dense module weights: its module state dict, or under ZeRO 3 (which saves only
    partitions) its own ``zero_to_fp32`` consolidation of the fp32 partitions (DeepSpeed reads
    those files with ``weights_only=False``; they were checked against the manifest first)."""
    if int(meta.get("zero_stage", 0)) >= 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return dict(get_fp32_state_dict_from_zero_checkpoint(load_dir, tag=dir_tag))
    return dict(load_file(os.path.join(load_dir, dir_tag, DS_MODEL_STATES))["module"])


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

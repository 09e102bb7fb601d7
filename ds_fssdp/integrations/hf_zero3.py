"""ZeRO stage 3 for the dense part of a model the loaders build (``hf_load.py``): partitioned while
it loads, one module whole at a time, as transformers' own ZeRO-3 load does, but from a skeleton on
the meta device, so the experts are never partitioned by ``zero.Init`` (each rank already holds its
own). Each module's steps and what is left to transformers' finalization: docs/design.md section 5,
"Big models in and out".
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.nn as nn
from deepspeed import comm as dist
from deepspeed.utils import logger


def load_dense_partitioned(model, files, load_config, ds_config: dict):
    """The dense part of ``model`` (meta; experts converted and owned) from the checkpoint
    ``files``, partitioned module by module. Returns what ``_load_pretrained_model`` returns."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model, dot_natural_key, rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    from ds_fssdp.integrations.hf_keys import split_mapping
    renamings, converters = split_mapping(load_config.weight_mapping)
    known = dict.fromkeys(model.state_dict(), True)

    def renamed(key):
        return rename_source_key(key, renamings, converters, model.base_model_prefix, known)[0]

    keys_of = defaultdict(list)  # module name -> checkpoint keys that land on its own tensors
    for key in sorted(files.keys(), key=dot_natural_key):
        if renamed(key) in known:
            keys_of[renamed(key).rpartition(".")[0]].append(key)
    rank = dist.get_rank()
    # Checkpoint keys landing nowhere, reported as transformers' loader reports them (the experts'
    # sources are expected: _keys_to_ignore_on_load_unexpected); the same on every rank.
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = {k for k in files.keys() if renamed(k) not in known and not any(p.search(renamed(k)) for p in ignore)}
    missing = set()  # model tensors no key lands on: initialized below by the family's init, and named

    def fill(module_name, module, owner, params, buffers):
        keys = keys_of.get(module_name, [])
        missing.update({_full(module_name, n) for n in params + buffers} - {renamed(k) for k in keys})
        if rank != 0:  # the others read only the buffers (never partitioned)
            keys = [k for k in keys if renamed(k) in {_full(module_name, n) for n in buffers}]
        loaded = set()
        if keys:
            info, _ = convert_and_load_state_dict_in_model(model, {k: files.read(k) for k in keys}, load_config)
            loaded = {n for n in params + buffers if _full(module_name, n) not in info.missing_keys}
        lacking = [n for n in buffers if n not in loaded] + ([n for n in params if n not in loaded] if rank == 0 else [])
        _materialize(module, params + buffers)
        if lacking:
            with torch.no_grad():
                owner._init_weights(module)  # what the checkpoint lacks (loaded tensors are flagged initialized)

    _partition_modules(model, ds_config, fill)
    model._weight_conversions = [c for c in load_config.weight_mapping or [] if c.was_used()]
    if missing and rank == 0:
        # Not in the returned info: transformers' finalization would replace them (already partitioned).
        logger.warning(f"fssdp: {len(missing)} tensors of the dense part are not in the checkpoint; initialized by "
                       f"the family's _init_weights and partitioned: {sorted(missing)[:8]}")
    # Tied weights are reported missing, as transformers' loader reports them: its finalization ties them.
    return LoadStateDictInfo(missing_keys=set(model.all_tied_weights_keys), unexpected_keys=unexpected,
                             mismatched_keys=set(), error_msgs=[], conversion_errors={}, skipped_pp_keys=set()), None


def init_dense_partitioned(model, ds_config: dict) -> None:
    """A fresh model's dense part (meta; experts lazy): each module with parameters of its own
    materialized, initialized by the family's ``_init_weights`` on rank 0 and partitioned, in turn."""

    def fill(name, module, owner, params, buffers):
        _materialize(module, params + buffers)
        with torch.no_grad():
            owner._init_weights(module)  # every rank: buffers stay whole; the parameters come from rank 0

    _partition_modules(model, ds_config, fill)
    for n, b in model.named_buffers():  # non-persistent ones (rotary tables): the family's init computes them
        if b.is_meta:
            owner, _, attr = n.rpartition(".")
            m = model.get_submodule(owner) if owner else model
            m.register_buffer(attr, torch.empty(b.shape, dtype=b.dtype), persistent=False)
            with torch.no_grad():
                model._init_weights(m)
    model.tie_weights()


def _partition_modules(model, ds_config: dict, fill) -> None:
    """Every module but the experts (each rank holds its own already), in init order:
    ``fill(name, module, owner, params, buffers)`` gives its own untied parameters and persistent
    buffers their values, then the parameters are partitioned."""
    from ds_fssdp.integrations.hf import converted_experts
    skip = {id(m) for _, m in converted_experts(model)}
    tied = set(model.all_tied_weights_keys)
    for name, module, owner in in_init_order(model):
        if id(module) in skip:
            continue
        params = [n for n, _ in module.named_parameters(recurse=False) if _full(name, n) not in tied]
        buffers = [n for n, _ in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
        fill(name, module, owner, params, buffers)
        if params:
            partition(module, [getattr(module, n) for n in params], ds_config)
        if params or buffers:
            module._is_hf_initialized = True  # transformers' finalization leaves it alone


def in_init_order(model):
    """``(name, module, owner)`` in the order transformers' ``initialize_weights`` visits them
    (children before their parent, ``smart_apply``), ``owner`` the nearest ``PreTrainedModel``
    whose ``_init_weights`` applies: the same draws from the same seed as its own initialization."""
    from transformers.modeling_utils import PreTrainedModel

    def visit(module, name, owner):
        for child_name, child in module.named_children():
            yield from visit(child, _full(name, child_name), child if isinstance(child, PreTrainedModel) else owner)
        yield name, module, owner

    yield from visit(model, "", model)


def zero_init_config(ds_config: dict) -> dict:
    """The config ``zero.Init`` partitions with: the user's, without the HF Trainer's "auto" values
    (filled only once the Trainer knows its batch sizes; partitioning needs the ZeRO section alone)."""
    def clean(value):
        return {k: clean(v) for k, v in value.items() if v != "auto"} if isinstance(value, dict) else value
    cfg = clean(ds_config)
    if not any(k in cfg for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    return cfg


def _materialize(module: nn.Module, names: list) -> None:
    """Host tensors for the meta parameters and buffers ``names`` of ``module`` (values to come)."""
    for n in names:
        t = getattr(module, n)
        if t is None or not t.is_meta:
            continue
        if n in module._parameters:
            setattr(module, n, nn.Parameter(torch.empty(t.shape, dtype=t.dtype), requires_grad=t.requires_grad))
        else:
            module.register_buffer(n, torch.empty(t.shape, dtype=t.dtype))


def partition(module: nn.Module, params: list, ds_config: dict) -> None:
    """Rank 0's values of ``params`` broadcast and partitioned over the world, as ``zero.Init``
    partitions a module it builds (``zero.Init(module=...)`` converts the parameters in place)."""
    import deepspeed
    holder = nn.Module()
    for i, p in enumerate(params):
        holder.register_parameter(f"p{i}", p)
    deepspeed.zero.Init(module=holder, config_dict_or_path=zero_init_config(ds_config))


def _full(module_name: str, name: str) -> str:
    return f"{module_name}.{name}" if module_name else name

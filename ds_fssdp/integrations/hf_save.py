"""Big HF MoE models out: a Hugging Face directory written by every rank, each its own experts
(docs/design.md section 5, "Big models in and out"; README, "Saving").

Legend: E experts, S experts a rank owns, P elements per expert row.

:func:`save_pretrained` (collective) writes what ``save_pretrained`` writes for the unconverted model:
rank 0 the dense part through transformers' own, each rank of the first FSSDP group its own experts'
byte ranges into shards laid out first (``hf_keys.SavedExperts``, ``safetensors_io.ShardFile``), all
into ``.tmp-<name>``, then renamed or moved into place, the index last. ``trainer.save_model`` and
``model.save_pretrained`` on a converted model are routed here; a PEFT model keeps PEFT's saving.
"""
from __future__ import annotations

import fnmatch
import functools
import importlib
import json
import os
import shutil

import torch

from ds_fssdp.runtime.checkpoint.collective import agreed, rank
from ds_fssdp.runtime.checkpoint.files import CheckpointError, fsync_dir, write_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DENSE = ".dense"
HONOURED = ("max_shard_size", "save_original_format", "overwrite", "safe_serialization")
# A model's files in a directory: what a save never mixes with (weights, their index, config, adapters).
MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.gguf",
               "config.json", "generation_config.json", "adapter_config.json")


def save_pretrained(model, out_dir, *, max_shard_size="50GB", save_original_format: bool = True,
                    overwrite: bool = False, **kw) -> str:
    """Write ``model`` (converted, sharded or not) as a Hugging Face directory; collective, returns
    ``out_dir``. ``overwrite``: a model's files already in ``out_dir`` are replaced, not refused."""
    for key, value in kw.items():
        if key == "safe_serialization" and value is not False:
            continue
        raise ValueError(f"ds_fssdp.integrations.hf.save_pretrained: {key}={value!r} is not supported (it is "
                         "collective, every rank calls it, and writes safetensors into a local directory; "
                         f"supported: {', '.join(HONOURED)})")
    from ds_fssdp.integrations.hf import _dense_like
    model = unwrap(model)
    if _is_peft(model):
        return _save_peft(model, out_dir, max_shard_size=max_shard_size)
    # saved in the dense parameters' dtype, as transformers saves (the experts follow, as hf_state_dict)
    return write_hf_dir(model, out_dir, dense=lambda: dense_state_dict(model),
                        rows=lambda module: own_rows(module, rank()),
                        dtype=getattr(_dense_like(model), "dtype", torch.float32),
                        max_shard_size=max_shard_size, save_original_format=save_original_format,
                        overwrite=overwrite)


def write_hf_dir(model, out_dir, *, dense, rows, dtype: torch.dtype, max_shard_size="50GB",
                 save_original_format: bool = True, overwrite: bool = False) -> str:
    """The writer behind :func:`save_pretrained` and ``hf_export.py``: ``model`` (converted; may be a meta
    skeleton) names and lays out everything; ``dense()``: rank 0's dense state dict (collective where it
    gathers); ``rows(module)``: this rank's ``(owned_E, rows_SP)`` of one experts module, or None."""
    from ds_fssdp.integrations.hf import converted_experts
    from transformers.utils.hub import convert_file_size_to_int

    from ds_fssdp.integrations.hf_keys import SavedExperts
    from ds_fssdp.integrations.safetensors_io import ShardFile, plan_shards
    out_dir = os.path.abspath(os.fspath(out_dir))
    modules = converted_experts(model)
    saved = [SavedExperts(model, name, module, dtype, original_format=save_original_format)
             for name, module in modules]
    shards = plan_shards([p for s in saved for p in s.planned], max_bytes=convert_file_size_to_int(max_shard_size))
    tmp = os.path.join(os.path.dirname(out_dir), f".tmp-{os.path.basename(out_dir)}")
    agreed(f"preparing {out_dir}", lambda: _prepare(out_dir, tmp, overwrite), root_only=True)
    try:
        held = {}  # a failure on one rank (rank 0 holds the dense part) fails every rank alike
        agreed(f"gathering the dense part of {out_dir}", lambda: held.update(state=dense()))  # ZeRO-3: collective
        files = [ShardFile(os.path.join(tmp, f"experts-{i:05d}.safetensors"), shard) for i, shard in enumerate(shards)]
        agreed(f"writing the dense part into {tmp}",
               lambda: _write_dense(model, tmp, held["state"], files, max_shard_size, save_original_format),
               root_only=True)
        del held
        file_of = {key: f for f in files for key in f.entries}
        agreed(f"writing the experts into {tmp}", lambda: _write_experts(modules, saved, file_of, rows))
        agreed(f"committing {out_dir}", lambda: _commit(tmp, out_dir, files, overwrite), root_only=True)
    except BaseException:
        if rank() == 0 and os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def unwrap(model):
    """The model inside a DeepSpeed engine (``engine.module``, whose state dict keys lack the
    engine's ``module.`` prefix) or a torch DDP wrapper."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.nn.parallel import DistributedDataParallel
    while isinstance(model, (DeepSpeedEngine, DistributedDataParallel)):
        model = model.module
    return model


def model_files(out_dir: str) -> list:
    """The entries of ``out_dir`` that are a model's files (weights, index, config): what a save
    into it would mix with."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in MODEL_FILES))


def _prepare(out_dir: str, tmp: str, overwrite: bool) -> None:
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not a directory")
    held = model_files(out_dir)
    if held and not overwrite:
        raise CheckpointError(f"{out_dir} already holds a model's files ({', '.join(held[:4])}"
                              f"{', ...' if len(held) > 4 else ''}): ds_fssdp.integrations.hf.save_pretrained never "
                              "mixes a model with another's files; save into a new directory, remove them, or pass "
                              "overwrite=True")
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)  # left by an unfinished save
    os.makedirs(tmp)


def dense_state_dict(model) -> dict:
    """The model's state dict (the converted experts hold no entries in it), on rank 0; under ZeRO-3
    each module's partitioned parameters gathered in turn (collective), as DeepSpeed's 16-bit
    consolidation does. Other ranks get {}."""
    from ds_fssdp.integrations.hf import expert_keys
    is_root = rank() == 0
    experts = expert_keys(model)
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        return {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in experts} if is_root else {}
    import deepspeed
    # A tied parameter (two names, one tensor) is gathered once, on every rank alike, and stays one
    # tensor: transformers' save drops the alias. ``gathered``: id -> its copy (rank 0's; None elsewhere).
    out, gathered = {}, {}
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        new = [p for _, p in own if id(p) not in gathered]
        with deepspeed.zero.GatheredParameters(new, modifier_rank=None):
            gathered.update((id(p), p.detach().cpu().clone() if is_root else None) for p in new)
        if is_root:
            out.update({f"{prefix}.{n}" if prefix else n: gathered[id(p)] for n, p in own})
            out.update({f"{prefix}.{n}" if prefix else n: b.detach().cpu().clone()
                        for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set})
    if is_root:  # in state_dict order, without what it leaves out (tied duplicates stay: transformers drops them)
        keys = model.state_dict(keep_vars=True).keys()
        out = {k: out[k] for k in keys if k in out and k not in experts}
    return out


def _write_dense(model, tmp: str, dense: dict, files: list, max_shard_size, original_format: bool) -> None:
    """Rank 0: transformers' own save of the dense part (config, generation config, shards), then the
    expert shards' headers."""
    from transformers.modeling_utils import PreTrainedModel
    _original(PreTrainedModel, "save_pretrained")(model, os.path.join(tmp, _DENSE), state_dict=dense,
                                                  max_shard_size=max_shard_size, save_original_format=original_format)
    for f in files:
        f.create()


def _write_experts(modules: list, saved: list, file_of: dict, rows) -> None:
    """Every rank: its own experts, layer by layer (the rows' HF tensors, reverse-converted)."""
    from ds_fssdp.integrations.hf_experts import to_hf
    from ds_fssdp.integrations.hf_load import CHUNK_BYTES
    for (name, module), s in zip(modules, saved):
        owned = rows(module)
        if owned is None:
            continue
        owned_E, rows_SP = owned
        step = max(1, CHUNK_BYTES // (module.spec.numel * rows_SP.element_size()))
        for i in range(0, owned_E.numel(), step):  # a few experts at a time in the HF layout
            part = rows_SP[i:i + step].detach()
            hf = {k: v.to(s.dtype) for k, v in to_hf(module.spec.views(part), module.layout).items()}
            for key, tensor, first_row in s.values(hf, owned_E[i:i + step]):
                file_of[key].write(key, tensor, first_row=first_row)
            del hf


def own_rows(module, rank: int):
    """``(owned_E, rows_SP)`` this rank writes for one experts module, or None: the owners of the
    first FSSDP group write (the other groups hold the same experts)."""
    if module.sharded is not None:
        shard = module.sharded
        shard.land()  # an EDP all-gather left in flight by the step
        from deepspeed import comm as dist
        group_size = dist.get_world_size(group=shard.group)
        return (shard.owned_E, shard.rows) if rank < group_size else None
    if module.owned is not None:
        o = module.owned
        return (o.owned_E, o.rows_SP) if rank == o.group_rank else None
    if module.lazy:
        raise CheckpointError(f"{type(module).__name__}: its experts are not drawn yet (lazy); save after "
                              "ds_fssdp.initialize, or materialize them (integrations.hf_load.materialize_experts)")
    return (torch.arange(module.num_experts), module.spec.flatten(module.export_experts())) if rank == 0 else None


def _commit(tmp: str, out_dir: str, files: list, overwrite: bool = False) -> None:
    """Rank 0: the final names, the index (last), the rename into place."""
    from ds_fssdp.integrations.safetensors_io import read_header
    dense_dir = os.path.join(tmp, _DENSE)
    names = sorted(os.listdir(dense_dir))
    if INDEX in names:
        with open(os.path.join(dense_dir, INDEX)) as f:
            dense_files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        dense_files = [SINGLE]
    total = len(dense_files) + len(files)
    weight_map, total_size, total_params = {}, 0, 0
    paths = [os.path.join(dense_dir, n) for n in dense_files] + [f.path for f in files]
    for i, path in enumerate(paths):
        final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        for key, entry in read_header(path)[0].items():
            weight_map[key] = final
            total_size += entry.nbytes
            total_params += entry.nbytes // entry.dtype.itemsize
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(path, os.path.join(tmp, final))
    for n in names:  # config.json, generation_config.json, remote code: transformers' own files
        if n == INDEX:
            os.remove(os.path.join(dense_dir, n))  # the dense part's alone; the index is written below
        elif n not in dense_files:
            os.replace(os.path.join(dense_dir, n), os.path.join(tmp, n))
    os.rmdir(dense_dir)
    write_file({"metadata": {"total_size": total_size, "total_parameters": total_params},
                "weight_map": dict(sorted(weight_map.items()))}, os.path.join(tmp, INDEX))
    fsync_dir(tmp)
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        _move_into(tmp, out_dir, overwrite)
        return
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty: the rename below takes its place
    os.rename(tmp, out_dir)
    fsync_dir(os.path.dirname(out_dir))


def _move_into(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Into a directory holding other things (the Trainer's ``output_dir``): one file at a time, the
    index last; a failure removes the ones moved."""
    if overwrite:
        for n in model_files(out_dir):  # the previous model's, stale shards included
            os.remove(os.path.join(out_dir, n))
    names = sorted(os.listdir(tmp), key=lambda n: (n == INDEX, not n.endswith(".safetensors"), n))
    clash = [n for n in names if os.path.lexists(os.path.join(out_dir, n))]
    if clash:
        raise CheckpointError(f"{out_dir} already has {clash}: the save would overwrite them")
    moved = []
    try:
        for n in names:
            os.replace(os.path.join(tmp, n), os.path.join(out_dir, n))
            moved.append(n)
        fsync_dir(out_dir)
    except BaseException:
        for n in moved:
            os.remove(os.path.join(out_dir, n))
        raise
    os.rmdir(tmp)


def _is_peft(model) -> bool:
    from ds_fssdp.integrations.peft_lora import has_peft
    return has_peft() and isinstance(model, importlib.import_module("peft").PeftModel)


def _save_peft(model, out_dir, *, max_shard_size) -> str:
    """PEFT saves its adapters as it always does (dense parameters, whole on rank 0)."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise CheckpointError("saving a PEFT model whose parameters ZeRO-3 partitions: use trainer.save_model, which "
                              "gathers the adapters as PEFT expects")
    agreed(f"saving the PEFT adapters into {out_dir}",
           lambda: model.save_pretrained(out_dir, max_shard_size=max_shard_size), root_only=True)
    return os.fspath(out_dir)


def _is_fssdp_model(model) -> bool:
    from ds_fssdp.integrations.hf import converted_experts
    return bool(converted_experts(model)) and not _is_peft(model)


def route_trainer_save() -> None:
    """Make ``transformers.Trainer.save_model`` write a converted model with :func:`save_pretrained`
    on every rank (idempotent); other models keep the Trainer's own."""
    import transformers
    route_model_save()

    def routed(original):
        def save_model(self, output_dir=None, _internal_call=False):
            model = self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model
            if not _is_fssdp_model(model):
                return original(self, output_dir, _internal_call=_internal_call)
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            save_pretrained(model, output_dir, overwrite=True)  # as the Trainer's own save overwrites
            if self.args.should_save:  # what Trainer._save adds beside the weights
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                from transformers.trainer import TRAINING_ARGS_NAME
                torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return save_model

    _route(transformers.Trainer, "save_model", routed)


def restore_trainer_save() -> None:
    """Undo :func:`route_trainer_save` (and :func:`route_model_save`)."""
    import transformers
    from transformers.modeling_utils import PreTrainedModel
    for owner, name in ((transformers.Trainer, "save_model"), (PreTrainedModel, "save_pretrained")):
        setattr(owner, name, _original(owner, name))


def route_model_save() -> None:
    """Make ``model.save_pretrained(out_dir, ...)`` on a converted model :func:`save_pretrained` (not given
    a ``state_dict``; transformers' own would write FSSDP's names without the sharded experts). Idempotent."""
    from transformers.modeling_utils import PreTrainedModel

    def routed(original):
        @functools.wraps(original)
        def save(self, save_directory, *args, **kwargs):
            if kwargs.get("state_dict") is not None or not _is_fssdp_model(self):
                return original(self, save_directory, *args, **kwargs)
            if args:
                raise ValueError(f"{type(self).__name__}.save_pretrained on a converted model takes keyword arguments "
                                 f"only (got {len(args)} positional): it is ds_fssdp.integrations.hf.save_pretrained")
            kwargs.setdefault("overwrite", True)  # as transformers' own save overwrites
            return save_pretrained(self, save_directory, **kwargs)
        return save

    _route(PreTrainedModel, "save_pretrained", routed)


def _route(owner, name: str, routed) -> None:
    """``owner.name = routed(original)``, the original kept on it as ``_fssdp_original`` (idempotent)."""
    original = getattr(owner, name)
    if getattr(original, "_fssdp_original", None) is None:
        replacement = routed(original)
        replacement._fssdp_original = original
        setattr(owner, name, replacement)


def _original(owner, name: str):
    """``owner.name`` as it was before :func:`_route` (transformers' own ``save_pretrained`` while routed)."""
    current = getattr(owner, name)
    return getattr(current, "_fssdp_original", current)

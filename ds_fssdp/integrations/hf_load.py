"""Big HF MoE models in: each rank reads (or draws) only the experts it will own (docs/design.md
section 5, "Big models in and out"; README, "Loading").

Legend: E experts, S experts a rank owns, P elements per expert row.

:func:`from_pretrained` is transformers' own ``from_pretrained`` with one step added where it would
start reading weights (``PreTrainedModel._load_pretrained_model``, wrapped for the call: :func:`_load`):
the skeleton's experts are converted, their keys planned (``hf_keys.plan_experts``) and each module
reads exactly its own experts (``planner.initial_ownership``); ZeRO-3's dense part: ``hf_zero3.py``.
:func:`from_config` builds a model with lazy experts, drawn per rank at ``initialize``.
"""
from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
from deepspeed import comm as dist
from deepspeed.utils import logger

from ds_fssdp.config import FSSDPConfig, FSSDPConfigError
from ds_fssdp.moe.experts_module import OwnedRows
from ds_fssdp.planner import initial_ownership
from ds_fssdp.runtime.checkpoint.files import CheckpointError, patched


# Experts read, converted and copied into their rows together: the loader's only other copy.
CHUNK_BYTES = 64 * 2**20
# HF kwargs the loader cannot honour: each is refused by name.
REFUSED_KWARGS = {
    "device_map": "DeepSpeed places the model, each rank keeps its own experts",
    **dict.fromkeys(("tp_plan", "tp_size", "device_mesh"), "transformers' tensor parallelism would split the experts "
                    "itself (use DeepSpeed AutoTP with FSSDP)"),
    "gguf_file": "each rank reads its own experts from safetensors files only",
    "state_dict": "each rank reads its own experts from the checkpoint's safetensors files",
}
# transformers versions the loader's hook (PreTrainedModel._load_pretrained_model) was tested with.
TESTED_TRANSFORMERS = ">=5.24,<5.26"
_HOOK_PARAMS = ("model", "state_dict", "checkpoint_files", "load_config")
_LOAD_CONFIG_FIELDS = ("hf_quantizer", "device_map", "weight_mapping")


@dataclass(frozen=True)
class Layout:
    """Where this rank sits when the experts are read: the stage's FSSDP layout."""
    rank: int
    world: int
    group_size: int
    zero_stage: int

    @property
    def group_rank(self) -> int:
        from ds_fssdp.runtime.groups import group_rank
        return group_rank(self.rank, self.group_size)


def read_config(ds_config) -> dict:
    """A DeepSpeed config (dict, JSON or HJSON path) as DeepSpeed reads it."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    if ds_config is None:
        raise ValueError("ds_config is required: the DeepSpeed config (dict or path) with the \"fssdp\" section "
                         "training will use (it decides which experts each rank reads)")
    cfg = dict(load_ds_config(ds_config))
    if not FSSDPConfig.from_ds_config(cfg).enabled:
        what = "has no \"fssdp\" section" if cfg.get("fssdp") is None else "sets fssdp.enabled false"
        raise FSSDPConfigError(f"ds_config {what}: ds_fssdp.integrations.hf's loaders read each rank's own experts for "
                               "FSSDP training (initialize would otherwise run plain DeepSpeed on a model holding a "
                               "share of its experts); without FSSDP load with transformers' "
                               "AutoModelForCausalLM.from_pretrained")
    return cfg


def layout_of(ds_config: dict, *, start_comm: bool = True) -> Layout:
    """The FSSDP layout ``initialize`` will build from the same config, DeepSpeed's comm started first;
    every config error names its key before any collective."""
    from deepspeed.accelerator import get_accelerator

    from ds_fssdp.runtime.elastic import init_distributed
    from ds_fssdp.runtime.engine import engine_device
    from ds_fssdp.runtime.zero3 import zero_stage
    fcfg = FSSDPConfig.from_ds_config(ds_config)
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE")) or "OMPI_COMM_WORLD_RANK" in os.environ
    if start_comm and (launched or dist.is_initialized()):  # a process without a launcher is one rank
        init_distributed(backend=get_accelerator().communication_backend_name())
        device = engine_device()
        if device.type != "cpu" and device.index is not None:
            get_accelerator().set_device(device.index)  # zero.Init and the rows go to this rank's device
    if not dist.is_initialized():
        return Layout(rank=0, world=1, group_size=1, zero_stage=zero_stage(ds_config))
    world = dist.get_world_size()
    group_size = fcfg.resolve_group_size(world, fcfg.resolve_ranks_per_node(world))
    return Layout(rank=dist.get_rank(), world=world, group_size=group_size, zero_stage=zero_stage(ds_config))


def from_pretrained(name_or_path, *, ds_config, **hf_kwargs):
    """``convert(AutoModelForCausalLM.from_pretrained(name_or_path, **hf_kwargs))``, each rank reading
    only the experts it will own; every rank calls it. The HF kwargs pass through but
    :data:`REFUSED_KWARGS`, refused by name before anything starts."""
    for key, why in REFUSED_KWARGS.items():
        if hf_kwargs.get(key) is not None:
            raise ValueError(f"ds_fssdp.integrations.hf.from_pretrained: {key}={hf_kwargs[key]!r} is not supported: "
                             f"{why}")
    cfg = read_config(ds_config)
    model = load_as(layout_of(cfg), cfg, name_or_path, **hf_kwargs)
    _route()
    return model


def load_as(layout: Layout, cfg: dict, name_or_path, **hf_kwargs):
    """:func:`from_pretrained` at a given layout (the rank reads what ``layout`` says it owns)."""
    import transformers
    with _hf_zero3_off(), _loading_hook(lambda *args: _load(layout, cfg, *args)):
        out = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, **hf_kwargs)
    _own_all(out[0] if isinstance(out, tuple) else out)  # (model, loading info) with output_loading_info=True
    return out


def _own_all(model) -> None:
    """Once transformers' loader is done (it would take them for missing weights): an ordinary module
    on a rank owning every expert, meta stand-ins beside the rows elsewhere (``keep_flags``)."""
    from ds_fssdp.integrations.hf import converted_experts
    for _, module in converted_experts(model):
        whole = module.__dict__.pop("_loaded_whole", None)
        if whole is not None:
            named, requires_grad = whole
            for name in module.spec.names:
                module._parameters[name] = nn.Parameter(named[name], requires_grad=requires_grad)
        elif module.owned is not None:
            module.keep_flags()  # PEFT or requires_grad_(False) freeze the owned experts too


def from_config(config, *, ds_config, seed: int = 0, **hf_kwargs):
    """A fresh ``AutoModelForCausalLM.from_config(config, **hf_kwargs)``, converted, the dense part
    initialized under ``seed``, the experts drawn per rank at ``initialize``; every rank calls it."""
    import transformers

    from ds_fssdp.integrations.hf import convert, converted_experts, expert_keys
    from ds_fssdp.runtime.zero3 import zero_stage
    cfg = read_config(ds_config)
    zero3 = zero_stage(cfg) == 3
    layout = layout_of(cfg, start_comm=zero3)
    with _hf_zero3_off(), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **hf_kwargs)
    convert(model, route_initialize=False)
    for name, module in converted_experts(model):
        object.__setattr__(module, "_fresh_init", (layer_seed(seed, name), model._init_weights))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if zero3:
            from ds_fssdp.integrations.hf_zero3 import init_dense_partitioned
            init_dense_partitioned(model, cfg)
        else:
            dense = set(model.state_dict()) - set(model.all_tied_weights_keys) - expert_keys(model)
            model._move_missing_keys_from_meta_to_device(dense, None, None, None)
            model._initialize_missing_keys(is_quantized=False)
            model.tie_weights()
    _route()
    logger.info(f"fssdp: {type(model).__name__} from its config, dense part initialized (seed {seed}); each rank "
                f"draws its own experts at initialize (rank {layout.rank} of {layout.world})")
    return model


def materialize_experts(model) -> nn.Module:
    """Every lazy experts module's experts, here: the single-process reference of a model from
    :func:`from_config` (what every rank of any world size draws its share of). Returns ``model``."""
    from ds_fssdp.integrations.hf import converted_experts
    for _, module in converted_experts(model):
        module.materialize_experts()
    return model


def layer_seed(seed: int, name: str) -> int:
    """The seed of a lazy experts module's experts: the model's seed and the module's name."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


def _route() -> None:
    from ds_fssdp.integrations.hf import route_deepspeed_initialize
    from ds_fssdp.integrations.hf_save import route_trainer_save
    route_deepspeed_initialize()
    route_trainer_save()


def _load(layout: Layout, cfg: dict, original, model, state_dict, checkpoint_files, load_config, *args, **kwargs):
    """transformers' ``_load_pretrained_model`` with each rank's own experts read first."""
    from ds_fssdp.integrations.hf import UnsupportedModelError, convert, converted_experts
    from ds_fssdp.integrations.hf_keys import UnmappableExpertsError, plan_experts
    from ds_fssdp.integrations.safetensors_io import CheckpointFiles
    from ds_fssdp.runtime.engine import engine_device
    model_type = getattr(model.config, "model_type", None)
    if state_dict is not None or not checkpoint_files:
        raise ValueError("ds_fssdp.integrations.hf.from_pretrained reads each rank's experts from the checkpoint's "
                         "safetensors files; from_pretrained(state_dict=...) or a model without files is not supported")
    if load_config.hf_quantizer is not None:
        raise UnsupportedModelError(f"ds_fssdp.integrations.hf.from_pretrained: model_type {model_type!r} is loaded "
                                    "quantized (quantization_config); ds_fssdp trains unquantized experts only")
    if load_config.device_map is not None:
        raise ValueError(f"ds_fssdp.integrations.hf.from_pretrained: device_map ({load_config.device_map!r}) is not "
                         f"supported: {REFUSED_KWARGS['device_map']}")
    convert(model, route_initialize=False)  # on the meta skeleton: refuses an unsupported family by name
    modules = converted_experts(model)
    files = CheckpointFiles(checkpoint_files)
    try:
        plan = plan_experts(model, modules, files, load_config.weight_mapping, model_type=model_type)
    except UnmappableExpertsError as err:
        raise UnsupportedModelError(str(err)) from None
    device = engine_device()
    read = sum(_read_module(module, plan[name], files, layout, config=model.config, device=device)
               for name, module in modules)
    # The experts' checkpoint keys are not in the converted model: transformers reports them as
    # unexpected (and never reads them); they are not.
    ignore = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    model._keys_to_ignore_on_load_unexpected = ignore | {re.escape(s.target) for p in plan.values() for s in p.values()}
    logger.info(f"fssdp: rank {layout.rank} read its own experts of {len(modules)} layers ({read / 2**20:.1f} MiB) "
                f"from {len(files.paths)} files")
    if layout.zero_stage == 3:
        from ds_fssdp.integrations.hf_zero3 import load_dense_partitioned
        return load_dense_partitioned(model, files, load_config, cfg)
    return original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)


def _read_module(module, sources: dict, files, layout: Layout, *, config, device) -> int:
    """Read this rank's experts of one module into its rows, a few experts at a time (each chunk
    read, converted and copied into place before the next is read); returns the bytes read."""
    from ds_fssdp.integrations.hf_experts import to_fssdp
    from ds_fssdp.integrations.hf_keys import read_owned
    param = module._parameters[module.spec.names[0]]
    dtype, requires_grad = param.dtype, param.requires_grad
    owner_E, owned_E = initial_ownership(module.num_experts, group_size=layout.group_size,
                                         group_rank=layout.group_rank)
    whole = owned_E.numel() == module.num_experts  # one rank owns every expert: an ordinary module
    if whole:
        dest = {name: torch.empty((module.num_experts, *shape), dtype=dtype)
                for name, shape in module.spec.shapes.items()}
    else:
        rows_SP = torch.empty(owned_E.numel(), module.spec.numel, dtype=dtype, device=device)
        dest = module.spec.views(rows_SP)
    step = max(1, CHUNK_BYTES // (module.spec.numel * dtype.itemsize))
    nbytes = 0
    for i in range(0, owned_E.numel(), step):
        part_E = owned_E[i:i + step]
        hf = {attr: read_owned(src, files, part_E, config=config, dtype=dtype) for attr, src in sources.items()}
        nbytes += sum(t.numel() * t.element_size() for t in hf.values())
        for name, tensor in to_fssdp(SimpleNamespace(**hf), module.layout, copy=False).items():
            dest[name][i:i + part_E.numel()].copy_(tensor)
        del hf
    if whole:  # installed after transformers' loader, which would take parameters here for missing weights
        for name in module.spec.names:
            module._parameters.pop(name)
        object.__setattr__(module, "_loaded_whole", (dest, requires_grad))
    else:
        module.adopt_owned_rows(OwnedRows(owner_E=owner_E, owned_E=owned_E, rows_SP=rows_SP,
                                          requires_grad=requires_grad, group_rank=layout.group_rank))
    return nbytes


def _loading_hook(hook):
    """transformers' ``PreTrainedModel._load_pretrained_model`` (where it starts reading weights
    into the meta skeleton) routed through ``hook(original, model, state_dict, checkpoint_files,
    load_config)`` for the duration."""
    from transformers.modeling_utils import PreTrainedModel
    original = PreTrainedModel.__dict__.get("_load_pretrained_model")
    check_transformers(original)
    return patched(PreTrainedModel, "_load_pretrained_model",
                   staticmethod(lambda *args, **kwargs: hook(original.__func__, *args, **kwargs)))


def check_transformers(original) -> None:
    """Another shape of the hooked ``_load_pretrained_model`` or of the ``load_config`` fields read is
    refused naming the installed version; a version outside :data:`TESTED_TRANSFORMERS` is warned about once."""
    import inspect

    from packaging.specifiers import SpecifierSet
    version = installed_transformers()
    where = (f"ds_fssdp.integrations.hf.from_pretrained: transformers {version} (tested: {TESTED_TRANSFORMERS}; the "
             "loader hooks its private PreTrainedModel._load_pretrained_model")
    if not isinstance(original, staticmethod):
        raise RuntimeError(f"{where}, which this version does not have as a static method)")
    params = tuple(inspect.signature(original.__func__).parameters)[:len(_HOOK_PARAMS)]
    if params != _HOOK_PARAMS:
        raise RuntimeError(f"{where}({', '.join(_HOOK_PARAMS)}, ...), which this version takes as "
                           f"({', '.join(params)}, ...)); install transformers{TESTED_TRANSFORMERS}")
    from transformers.modeling_utils import LoadStateDictConfig
    fields = getattr(LoadStateDictConfig, "__dataclass_fields__", None) or vars(LoadStateDictConfig)
    missing = [f for f in _LOAD_CONFIG_FIELDS if f not in fields]
    if missing:
        raise RuntimeError(f"{where} and reads LoadStateDictConfig.{', '.join(missing)}, which this version does not "
                           f"have); install transformers{TESTED_TRANSFORMERS}")
    if version not in SpecifierSet(TESTED_TRANSFORMERS) and str(version) not in _WARNED:
        _WARNED.add(str(version))
        logger.warning(f"{where}: this version is outside the tested range; its signature matches, so loading goes "
                       "on, but check the loaded rows against the checkpoint (tests/test_hf_io.py))")


_WARNED: set = set()


def installed_transformers():
    """The installed transformers version (``packaging.version.Version``)."""
    import transformers
    from packaging.version import Version
    return Version(transformers.__version__)


def _hf_zero3_off():
    """No ZeRO-3 HF DeepSpeed config for the duration (``TrainingArguments`` with ZeRO-3 would build the
    model under ``zero.Init``, the experts partitioned like dense weights; ``hf_zero3.py`` partitions)."""
    from transformers.integrations import deepspeed as hf_ds
    return patched(hf_ds, "_hf_deepspeed_config_weak_ref", None)


__all__ = ["from_pretrained", "from_config", "materialize_experts", "layout_of", "Layout", "CheckpointError"]

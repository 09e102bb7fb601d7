"""Train Hugging Face ``transformers`` MoE models with FSSDP: in-place conversion and the HF Trainer.

Supported: Mixtral, Qwen2-MoE (with its shared expert), Qwen3-MoE and OLMoE (transformers 5.x,
fused 3-D experts). Any other model is refused with :class:`UnsupportedModelError` naming it.

With the HF Trainer the one line a user adds is the conversion, before building the Trainer::

    import ds_fssdp.integrations.hf as fssdp_hf

    model = AutoModelForCausalLM.from_pretrained(...)          # or from_config
    model = fssdp_hf.convert(model)                             # <- the one line
    args = TrainingArguments(..., deepspeed="ds_configs/hf_fssdp.json")   # has an "fssdp" section
    trainer = Trainer(model=model, args=args, ...)
    trainer.train()
    fssdp_hf.unconvert(model)          # every rank: gather the experts back into the HF layout
    trainer.save_model(out_dir)        # or model.save_pretrained(out_dir) on rank 0

launched as usual (``deepspeed --num_gpus N train.py`` or ``torchrun --nproc_per_node N train.py``).
``convert`` routes ``deepspeed.initialize`` (which accelerate looks up at call time) to
:func:`initialize`, i.e. ``ds_fssdp.initialize``; models without FSSDP layers still get plain
DeepSpeed from it. Without the Trainer, call ``ds_fssdp.initialize(model=model, config=...)``.

What the conversion keeps exact (fp32, before training the converted model's logits and loss
equal the original's):

* each sparse MoE block becomes a :class:`~ds_fssdp.integrations.hf_blocks.FSSDPSparseMoeBlock`:
  the HF router module itself (same routing math, same ``gate.weight`` key), the experts mapped
  exactly into an :class:`~ds_fssdp.FSSDPMoE` (transposes of the fused tensors), Qwen2-MoE's shared
  expert and its sigmoid gate as ordinary dense modules, Mixtral's router jitter in training;
* the auxiliary loss: HF still records the router logits and adds
  ``router_aux_loss_coef * load_balancing_loss_func(...)`` in the model's own forward when
  ``config.output_router_logits`` is true. As in plain DeepSpeed data parallelism, each rank's aux
  loss is computed from its own tokens.

Refused: gradient checkpointing of the decoder layers (the recomputed forward would plan the
experts' placement again; ``ds_fssdp.initialize`` through this module raises), experts modules
with another layout or activation than silu. ZeRO stage 3 works (tests/test_hf_trainer.py) for a
model built outside ``deepspeed.zero.Init``: create it before ZeRO-3 ``TrainingArguments`` (HF
builds models under ``zero.Init`` once those exist); partitioned experts are refused by name.

Saving: the state dict of a converted model holds the experts as ``<block>.moe.w_gate`` etc. (or
not at all once sharded). :func:`unconvert` puts every original HF block back in place with the
trained weights (a collective: every rank calls it); :func:`hf_state_dict` returns the HF-layout
state dict without changing the model (also collective), e.g. for
``model.save_pretrained(out_dir, state_dict=fssdp_hf.hf_state_dict(model))`` mid-training. Both
round-trip through ``save_pretrained`` / ``from_pretrained``. Trainer checkpoints taken while the
model is converted (``save_strategy`` other than ``"no"``) do not hold the sharded experts: use
``save_strategy="no"`` and save after :func:`unconvert`.
"""
from __future__ import annotations

import deepspeed
import torch.nn as nn
from deepspeed.utils import logger

import ds_fssdp.runtime.engine as _engine
from ds_fssdp.config import FSSDPConfigError
from ds_fssdp.integrations.hf_blocks import FAMILIES, Family, FSSDPSparseMoeBlock

SUPPORTED_MODEL_TYPES = tuple(f.model_type for f in FAMILIES)


class UnsupportedModelError(ValueError):
    """The model has no sparse MoE block of a supported family."""


def convert(model: nn.Module, *, route_initialize: bool = True) -> nn.Module:
    """Replace every sparse MoE block of ``model`` in place by an FSSDP block holding the same
    router and expert weights; returns ``model``. ``route_initialize``: also route
    ``deepspeed.initialize`` to :func:`initialize` (what the HF Trainer needs)."""
    if converted_blocks(model):
        raise ValueError(f"convert: {type(model).__name__} is already converted")
    found = 0
    for family in _available_families():
        cls = family.block_class()
        # Exact class: a subclass may change the block's math.
        targets = [(name, m) for name, m in model.named_modules() if type(m) is cls]
        for name, block in targets:
            _set_submodule(model, name, FSSDPSparseMoeBlock(block, family, where=f"{name} ({cls.__name__})"))
        found += len(targets)
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise UnsupportedModelError(
            f"ds_fssdp.integrations.hf.convert: {type(model).__name__} (model_type {model_type!r}) has no sparse "
            f"MoE block ds_fssdp can map; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    logger.info(f"fssdp: converted {found} sparse MoE blocks of {type(model).__name__}")
    if route_initialize:
        route_deepspeed_initialize()
    return model


def converted_blocks(model: nn.Module) -> list:
    """``[(name, FSSDPSparseMoeBlock)]`` in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSSDPSparseMoeBlock)]


def unconvert(model: nn.Module) -> nn.Module:
    """Put the original HF blocks back with the current weights; returns ``model``. Collective once
    ``ds_fssdp.initialize`` has sharded the experts: every rank calls it. The FSSDP engine must not
    train the model afterwards (its expert shards are no longer part of it)."""
    for name, block in converted_blocks(model):
        _set_submodule(model, name, block.to_hf_block())
    return model


def hf_state_dict(model: nn.Module) -> dict:
    """The state dict the unconverted model would have (experts as HF fused tensors), without
    changing the model. Collective once sharded: every rank calls it and gets the full dict."""
    state = model.state_dict()
    for name, block in converted_blocks(model):
        prefix = f"{name}." if name else ""
        for key in [k for k in state if k.startswith(f"{prefix}moe.")]:
            del state[key]
        for key, tensor in block.hf_expert_tensors().items():
            state[f"{prefix}experts.{key}"] = tensor
    return state


def initialize(*args, **kwargs):
    """``ds_fssdp.initialize`` with the checks a converted HF model needs (what ``deepspeed.initialize``
    is routed to)."""
    model = kwargs.get("model")
    if model is None and len(args) > 1:
        model = args[1]
    if model is not None and converted_blocks(model) and _checkpointing(model):
        raise FSSDPConfigError("gradient checkpointing (TrainingArguments.gradient_checkpointing / "
                               "model.gradient_checkpointing_enable) is not supported with fssdp: the recomputed "
                               "forward would plan the experts again; turn it off")
    return _engine.initialize(*args, **kwargs)


def route_deepspeed_initialize() -> None:
    """Make ``deepspeed.initialize`` call :func:`initialize` (idempotent). DeepSpeed's own stays
    reachable as ``ds_fssdp.runtime.engine._deepspeed_initialize``, so this does not recurse."""
    if deepspeed.initialize is not initialize:
        deepspeed.initialize = initialize
        logger.info("fssdp: deepspeed.initialize now goes through ds_fssdp.initialize")


def restore_deepspeed_initialize() -> None:
    """Undo :func:`route_deepspeed_initialize`."""
    deepspeed.initialize = _engine._deepspeed_initialize


def _checkpointing(model: nn.Module) -> bool:
    # What PreTrainedModel.is_activation_checkpointing (is_gradient_checkpointing before 5.x) checks.
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _available_families():
    for family in FAMILIES:
        try:
            family.block_class()
        except (ImportError, AttributeError) as err:  # an older transformers without this family
            logger.info(f"fssdp: transformers has no {family.block} ({err}); skipping {family.model_type}")
            continue
        yield family


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


__all__ = ["SUPPORTED_MODEL_TYPES", "UnsupportedModelError", "Family", "convert", "converted_blocks", "unconvert",
           "hf_state_dict", "initialize", "route_deepspeed_initialize", "restore_deepspeed_initialize"]

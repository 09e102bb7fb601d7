"""Train Hugging Face ``transformers`` MoE models with FSSDP: in-place conversion and the HF Trainer
(README: "Hugging Face models and the Trainer", "Big models in and out").

:func:`convert` replaces each experts module on transformers' experts contract
(``@use_experts_implementation``) by an :class:`~ds_fssdp.integrations.hf_experts.FSSDPHFExperts`
holding the same weights, the family's block, router, shared experts and scaling untouched; a model
without one, or whose experts compute what ds_fssdp's variants do not, is refused with
:class:`UnsupportedModelError`. It also routes ``deepspeed.initialize`` to ``ds_fssdp.initialize``
and the Trainer's ``save_model`` to :func:`save_pretrained` (``hf_save.py``). :func:`unconvert` puts
the HF experts modules back with the trained weights and :func:`hf_state_dict` returns the HF-layout
state dict without changing the model (both collective once sharded).
"""
from __future__ import annotations

import deepspeed
import torch.nn as nn
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.utils import logger

import ds_fssdp.runtime.engine as _engine
from ds_fssdp.integrations import peft_lora
from ds_fssdp.integrations.hf_experts import FSSDPHFExperts, UnsupportedExpertsError, is_experts_module
from ds_fssdp.integrations.hf_load import from_config, from_pretrained, materialize_experts
from ds_fssdp.integrations.hf_save import restore_trainer_save, route_trainer_save, save_pretrained
from ds_fssdp.moe.side import bind_shared

# Where a family keeps the selection bias of its router: on the block or on its router module.
ROUTER_BIAS = "e_score_correction_bias"


class UnsupportedModelError(ValueError):
    """The model has no experts module ds_fssdp can map (or one whose math it cannot reproduce)."""


def convert(model: nn.Module, *, route_initialize: bool = True) -> nn.Module:
    """Replace every HF experts module of ``model`` in place by an :class:`FSSDPHFExperts`
    holding the same weights; returns ``model``. ``route_initialize``: also route
    ``deepspeed.initialize`` to :func:`initialize` (what the HF Trainer needs)."""
    if converted_experts(model):
        raise ValueError(f"convert: {type(model).__name__} is already converted")
    if isinstance(model, PipelineModule):
        raise UnsupportedModelError("ds_fssdp.integrations.hf.convert: the model is a DeepSpeed PipelineModule; the "
                                    "Hugging Face path has no pipeline parallelism (transformers has no pipeline "
                                    "path): convert the transformers model, or build a PipelineModule of FSSDPMoE "
                                    "layers (ds_fssdp.models.GPTMoEPipe)")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    targets = [(name, m) for name, m in model.named_modules() if is_experts_module(m)]
    if not targets:
        raise UnsupportedModelError(
            f"ds_fssdp.integrations.hf.convert: {type(model).__name__} (model_type {model_type!r}) has no experts module "
            "on transformers' experts contract (@use_experts_implementation with fused [E, ...] expert tensors); "
            "ds_fssdp converts only those (see the README for the families tested)")
    top_k = _top_k(model)
    for name, experts in targets:
        where = f"{name} ({type(experts).__name__})"
        try:
            module = FSSDPHFExperts(experts, model_type=model_type, where=where, top_k=top_k)
        except UnsupportedExpertsError as err:
            raise UnsupportedModelError(str(err)) from None
        # A PEFT model's experts sit inside LoRA wrappers (``experts.base_layer.base_layer``).
        site = peft_lora.strip_wrappers(name)
        block_name, _, child = site.rpartition(".")
        block = model.get_submodule(block_name) if block_name else model
        _bind_router_bias(block, block_name, module)
        model.set_submodule(name, module)
        peft_lora.adopt(model.get_submodule(site), module, where=where)
        module._adopt_handle = block.register_forward_pre_hook(peft_lora.adopt_hook(child, where))
        shape = module.spec.cost_shape(1)
        module.side = bind_shared(block, child, hidden=shape.hidden, ffn=shape.ffn, matrices=shape.matrices)
    logger.info(f"fssdp: converted {len(targets)} experts modules of {type(model).__name__} ({model_type}): "
                f"{targets[0][1].__class__.__name__} -> {converted_experts(model)[0][1].extra_repr()}")
    if route_initialize:
        route_deepspeed_initialize()
        route_trainer_save()
    return model


def converted_experts(model: nn.Module) -> list:
    """``[(name, FSSDPHFExperts)]`` in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSSDPHFExperts)]


def expert_keys(model: nn.Module) -> set:
    """The state-dict keys of the converted experts modules' own tensors (``<name>.w_gate`` ...):
    what the dense part of the model is not."""
    return {f"{name}.{n}" if name else n for name, m in converted_experts(model) for n in m.spec.names}


def unconvert(model: nn.Module) -> nn.Module:
    """Put the original HF experts modules back with the current weights; returns ``model``.
    Collective once ``ds_fssdp.initialize`` has sharded the experts: every rank calls it. The FSSDP
    engine must not train the model afterwards (its expert shards are no longer part of it)."""
    like = _dense_like(model)
    for name, module in converted_experts(model):
        model.set_submodule(name, module.to_hf_module(like))
        if module._adopt_handle is not None:
            module._adopt_handle.remove()
        if module.side is not None:
            module.side.release()
        if peft_lora.has_peft():
            peft_lora.release(model.get_submodule(peft_lora.strip_wrappers(name)))
    return model


def hf_state_dict(model: nn.Module) -> dict:
    """The state dict the unconverted model would have (experts as HF fused tensors), without
    changing the model. Collective once sharded: every rank calls it and gets the full dict."""
    state = model.state_dict()
    like = _dense_like(model)
    for name, module in converted_experts(model):
        prefix = f"{name}." if name else ""
        for key in module.spec.names:
            state.pop(prefix + key, None)
        state.update({prefix + key: tensor for key, tensor in module.hf_tensors(like).items()})
    return state


initialize = _engine.initialize  # what deepspeed.initialize is routed to


def route_deepspeed_initialize() -> None:
    """Make ``deepspeed.initialize`` call :func:`initialize` (idempotent). DeepSpeed's own stays
    reachable as ``ds_fssdp.runtime.engine._deepspeed_initialize``, so this does not recurse."""
    if deepspeed.initialize is not initialize:
        deepspeed.initialize = initialize
        logger.info("fssdp: deepspeed.initialize now goes through ds_fssdp.initialize")


def restore_deepspeed_initialize() -> None:
    """Undo :func:`route_deepspeed_initialize`."""
    deepspeed.initialize = _engine._deepspeed_initialize


def _top_k(model):
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    keys = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
    values = (getattr(config, key, None) for key in keys)
    return next((v for v in values if isinstance(v, int)), None)


def _bind_router_bias(block: nn.Module, block_name: str, module: FSSDPHFExperts) -> None:
    """The block's (or its router's) ``e_score_correction_bias`` of [E], if the family has one."""
    candidates = [(block_name, block)] + [(f"{block_name}.{n}" if block_name else n, c)
                                          for n, c in block.named_children()]
    for owner_name, owner in candidates:
        bias = owner._buffers.get(ROUTER_BIAS) if ROUTER_BIAS in owner._buffers else owner._parameters.get(ROUTER_BIAS)
        if bias is not None and tuple(bias.shape) == (module.num_experts, ):
            module.bind_router_bias(owner, ROUTER_BIAS, where=f"{owner_name}.{ROUTER_BIAS}")
            return


def _dense_like(model: nn.Module):
    """A dense parameter: the device and dtype HF tensors are returned in (bf16 once an engine casts)."""
    return next((p for p in model.parameters() if p.device.type != "meta"), None)


__all__ = ["UnsupportedModelError", "convert", "converted_experts", "unconvert", "hf_state_dict", "initialize",
           "route_deepspeed_initialize", "restore_deepspeed_initialize", "from_pretrained", "from_config",
           "materialize_experts", "save_pretrained", "route_trainer_save", "restore_trainer_save"]

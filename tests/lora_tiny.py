"""Tiny Hugging Face MoE models with a PEFT LoRA on their experts (and on the attention output),
in either order with ``convert``, with random factors (PEFT starts B at zero, which would hide
every error in B's layout)."""
from __future__ import annotations

import torch

from hf_tiny import tiny_model

EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_config(**overrides):
    from peft import LoraConfig
    kwargs = dict(r=2, lora_alpha=4, target_parameters=EXPERT_TARGETS, target_modules=["o_proj"],
                  rank_pattern={"layers.1.mlp.experts.down_proj": 3})
    kwargs.update(overrides)
    return LoraConfig(**kwargs)


@torch.no_grad()
def randomize_lora(model, seed: int = 5) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def lora_model(model_type: str, *, order: str | None = None, route_initialize: bool = False, **overrides):
    """``order``: None (plain HF + PEFT), "before" (PEFT, then ``convert``) or "after" (``convert``,
    then PEFT)."""
    from peft import get_peft_model

    import ds_fssdp.integrations.hf as fssdp_hf
    model = tiny_model(model_type)
    if order == "after":
        model = fssdp_hf.convert(model, route_initialize=route_initialize)
    model = get_peft_model(model, lora_config(**overrides))
    randomize_lora(model)
    if order == "before":
        fssdp_hf.convert(model, route_initialize=route_initialize)
    return model


def lora_state(model) -> dict:
    """The LoRA factors by PEFT's saved key (``get_peft_model_state_dict``)."""
    from peft import get_peft_model_state_dict
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}

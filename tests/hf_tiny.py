"""Tiny Hugging Face MoE models of every tested family (``ds_fssdp.integrations.hf_tiny``), with a
random selection bias where the family has one (so it matters), and their batches."""
from __future__ import annotations

import os

import torch

from ds_fssdp.integrations.hf_tiny import TESTED_FAMILIES, tiny_config

VOCAB = 64
# Families whose router carries an e_score_correction_bias (DeepSeek-V3's aux-loss-free balancing).
BIASED = ("deepseek_v3", "glm4_moe", "minimax_m2")
FAMILIES = TESTED_FAMILIES


@torch.no_grad()
def tiny_model(model_type: str, seed: int = 0, **overrides):
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, vocab=VOCAB, **overrides))
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
    return model


def batch(seed: int = 1, *, rows: int = 3, seq: int = 12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on one row: the aux loss is masked too
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def dp_step(model, params: list, opt, batches: list, clip: float) -> list:
    """One data-parallel optimizer step by hand (DeepSpeed's math, single process): each rank's
    loss on its own batch (``batches`` in rank order) over the world size, one global-norm clip,
    one step. Returns the ranks' losses."""
    opt.zero_grad()
    losses = []
    for data in batches:
        loss = model(**data).loss
        (loss / len(batches)).backward()
        losses.append(loss.item())
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    return losses


__all__ = ["BIASED", "FAMILIES", "VOCAB", "batch", "dp_step", "tiny_config", "tiny_model"]


def saved_tensors(path) -> dict:
    """Every tensor of the safetensors files in the directory ``path``, by key."""
    from safetensors.torch import load_file
    out = {}
    for n in os.listdir(path):
        if n.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, n)))
    return out

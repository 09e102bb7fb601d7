"""A small GPT with an FSSDPMoE in every block: the model of the main job, tests and benchmarks.

Legend: B batch, S sequence, H hidden (d_model), V vocabulary.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ds_fssdp.moe.layer import FSSDPMoE


@dataclass
class GPTMoEConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    ffn_hidden: int = 512
    num_experts: int = 8
    k: int = 2
    activation: str = "gelu"
    aux_loss_coef: float = 0.001
    z_loss_coef: float = 0.0
    init_std: float = 0.02
    aux_free_bias: bool = False
    bias_update_rate: float = 1e-3
    # Activation checkpointing of every block in training: "none", "torch" (non-reentrant
    # torch.utils.checkpoint), "torch-reentrant", or "deepspeed" (deepspeed.checkpointing).
    activation_checkpointing: str = "none"

    def __post_init__(self):
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"activation_checkpointing ({self.activation_checkpointing!r}) must be one of "
                             f"{tuple(CHECKPOINTING)}")


CHECKPOINTING = {
    "none": None,
    "torch": lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False),
    "torch-reentrant": lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True),
    "deepspeed": lambda fn, *args: importlib.import_module("deepspeed").checkpointing.checkpoint(fn, *args),
}


class CausalSelfAttention(nn.Module):

    def __init__(self, cfg: GPTMoEConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x_BSH):
        B, S, H = x_BSH.shape
        q, k, v = self.qkv(x_BSH).split(H, dim=-1)
        shape = (B, S, self.n_heads, H // self.n_heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, H))


class Block(nn.Module):

    def __init__(self, cfg: GPTMoEConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = FSSDPMoE(hidden_size=cfg.d_model, ffn_hidden_size=cfg.ffn_hidden, num_experts=cfg.num_experts,
                            k=cfg.k, activation=cfg.activation, z_loss_coef=cfg.z_loss_coef, init_std=cfg.init_std,
                            aux_free_bias=cfg.aux_free_bias, bias_update_rate=cfg.bias_update_rate)

    def forward(self, x_BSH):
        x_BSH = x_BSH + self.attn(self.ln1(x_BSH))
        moe_out, l_aux, _ = self.moe(self.ln2(x_BSH))
        return x_BSH + moe_out, l_aux


class GPTMoE(nn.Module):
    """``forward(idx, targets)`` returns the loss (cross-entropy + aux_loss_coef * sum of l_aux);
    ``forward(idx)`` returns the logits."""

    def __init__(self, cfg: GPTMoEConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2 and "moe" not in name:
                nn.init.normal_(p, std=cfg.init_std)

    def moe_layers(self) -> list:
        return [b.moe for b in self.blocks]

    def forward(self, idx_BS, targets_BS=None):
        S = idx_BS.shape[1]
        x = self.tok_emb(idx_BS) + self.pos_emb(torch.arange(S, device=idx_BS.device))
        aux = x.new_zeros((), dtype=torch.float32)
        checkpoint = CHECKPOINTING[self.cfg.activation_checkpointing] if self.training else None
        for block in self.blocks:
            x, l_aux = block(x) if checkpoint is None or not torch.is_grad_enabled() else checkpoint(block, x)
            aux = aux + l_aux
        logits_BSV = self.head(self.ln_f(x))
        return logits_BSV if targets_BS is None else lm_loss(logits_BSV, targets_BS) + self.cfg.aux_loss_coef * aux


def lm_loss(logits_BSV, targets_BS):
    """The cross-entropy (in fp32)."""
    return F.cross_entropy(logits_BSV.float().reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1))

"""GPT-MoE as a DeepSpeed ``PipelineModule``: the same modules, cut into pipeline stages.

Legend: B batch, S sequence, H hidden (d_model), V vocabulary.

``GPTMoEPipe(model, num_stages=S)`` wraps a :class:`~ds_fssdp.models.gpt_moe.GPTMoE`'s modules (the
same weights) as ``[embedding, block 0, ..., block n-1, head]`` and keeps this rank's stage; the loss
is the cross-entropy on the last stage, each block's router loss entering the backward where the
block is (``moe/aux_loss.AuxLossToBackward``), so ``train_batch`` returns what ``GPTMoE`` returns.
Stages balance the MoE blocks (DeepSpeed's ``type:BlockPipe``) or are cut at ``parts`` (stage s:
layers ``parts[s] .. parts[s+1] - 1``). Activation checkpointing: the model's own mode, or
DeepSpeed's pipeline one (``activation_checkpoint_interval``), of blocks only (the embedding's input
is token ids, which DeepSpeed's reentrant checkpoint cannot differentiate through).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule

from ds_fssdp.models.gpt_moe import CHECKPOINTING, GPTMoE, lm_loss
from ds_fssdp.moe.aux_loss import AuxLossToBackward


class EmbeddingPipe(nn.Module):

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding):
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, idx_BS):
        return self.tok_emb(idx_BS) + self.pos_emb(torch.arange(idx_BS.shape[1], device=idx_BS.device))


class BlockPipe(nn.Module):

    def __init__(self, block: nn.Module, *, aux_loss_coef: float, checkpointing: str = "none"):
        super().__init__()
        self.block = block
        self.aux = AuxLossToBackward(aux_loss_coef)
        self.checkpoint = CHECKPOINTING[checkpointing]

    def forward(self, x_BSH):
        checkpointed = self.checkpoint is not None and self.training and torch.is_grad_enabled()
        return self.aux(*(self.checkpoint(self.block, x_BSH) if checkpointed else self.block(x_BSH)))


class HeadPipe(nn.Module):

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear):
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x_BSH):
        return self.head(self.ln_f(x_BSH))


class GPTMoEPipe(PipelineModule):
    """``model``'s modules as pipeline stages (collective: DeepSpeed's grid is built here)."""

    def __init__(self, model: GPTMoE, *, num_stages: int, parts: list | None = None,
                 activation_checkpoint_interval: int = 0, **kwargs):
        cfg = model.cfg
        layers = ([EmbeddingPipe(model.tok_emb, model.pos_emb)] +
                  [BlockPipe(b, aux_loss_coef=cfg.aux_loss_coef, checkpointing=cfg.activation_checkpointing)
                   for b in model.blocks] + [HeadPipe(model.ln_f, model.head)])
        if parts is not None and (len(parts) != num_stages + 1 or parts[0] != 0 or parts[-1] != len(layers)
                                  or any(a > b for a, b in zip(parts, parts[1:]))):
            raise ValueError(f"parts ({parts}) must be {num_stages + 1} non-decreasing stage boundaries from 0 to "
                             f"{len(layers)} (the embedding, {len(model.blocks)} blocks and the head)")
        object.__setattr__(self, "_fixed_parts", None if parts is None else list(parts))
        super().__init__(layers=layers, num_stages=num_stages, loss_fn=lm_loss, partition_method="type:BlockPipe",
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         checkpointable_layers=["BlockPipe"], **kwargs)
        self.cfg = cfg

    def _partition_layers(self, method="uniform"):
        if self._fixed_parts is None:
            return super()._partition_layers(method)
        self.parts = list(self._fixed_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def moe_layers(self) -> list:
        """This stage's MoE layers, in model order."""
        return [m.block.moe for m in self.forward_funcs if isinstance(m, BlockPipe)]

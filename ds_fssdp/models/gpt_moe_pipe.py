"""GPT-MoE as a DeepSpeed ``PipelineModule``: the same modules, cut into pipeline stages.

Legend: B batch, S sequence, H hidden (d_model), V vocabulary.

``GPTMoEPipe(model, num_stages=S)`` wraps an existing :class:`~ds_fssdp.models.gpt_moe.GPTMoE`'s
modules (so both start from the same weights) as ``[embedding, block 0, ..., block n-1, head]``
and keeps only this rank's stage; the loss is the cross-entropy on the last stage. Each block's
router loss enters the backward where the block is (``moe/aux_loss.AuxLossToBackward`` with the
model's ``aux_loss_coef``), and the FSSDP pipeline engine's ``train_batch`` returns
cross-entropy plus those terms, what ``GPTMoE`` returns without pipelining. Stages are cut to
balance the MoE blocks (DeepSpeed's ``type:BlockPipe``), or at ``parts`` (DeepSpeed's stage
boundaries: stage s holds layers ``parts[s] .. parts[s+1] - 1``). Activation checkpointing: the
model's own mode (``GPTMoEConfig.activation_checkpointing``), or DeepSpeed's pipeline one
(``activation_checkpoint_interval`` here or ``pipeline.activation_checkpoint_interval`` in the
config), which checkpoints blocks only (``checkpointable_layers``: the embedding's input is the
token ids, which DeepSpeed's reentrant checkpoint cannot differentiate through).
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
        if self.checkpoint is None or not (self.training and torch.is_grad_enabled()):
            x_BSH, l_aux = self.block(x_BSH)
        else:
            x_BSH, l_aux = self.checkpoint(self.block, x_BSH)
        return self.aux(x_BSH, l_aux)


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

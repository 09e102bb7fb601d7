"""Inputs and the forward of stacked MoE layers, shared by the chunked-exchange tests
(test_pipeline.py, test_pipeline_dedup.py)."""
from __future__ import annotations

import torch


def rank_inputs(case: dict, rank: int, hidden: int) -> tuple:
    """This rank's tokens and the output gradient: ``case["tokens"][rank]`` rows of ``hidden``,
    seeded by the case and the rank."""
    gen = torch.Generator().manual_seed(1000 * case["seed"] + rank)
    T = case["tokens"][rank]
    return torch.randn(T, hidden, generator=gen), torch.randn(T, hidden, generator=gen)


def model_forward(layers, x, ckpt):
    """The layers in sequence, their aux losses summed; ``ckpt``: None / False (plain), "torch" or
    True (non-reentrant activation checkpointing), "reentrant"."""
    def run(x):
        l_aux = 0.0
        for layer in layers:
            x, aux, _ = layer(x)
            l_aux = l_aux + aux
        return x, l_aux
    if ckpt in ("torch", True):
        return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
    if ckpt == "reentrant":
        return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=True)
    return run(x)

"""Inputs, sharded layers and the forward of stacked MoE layers, shared by the chunked-exchange
tests (test_pipeline.py, test_pipeline_dedup.py)."""
from __future__ import annotations

import dataclasses

import torch


def attach_shards(layers, placements, *, rank: int, topo, exchange, degrees, options, prepare=None) -> list:
    """Each layer sharded over ``topo``'s ranks with its (owner_E, placement_ED) of ``placements``
    (the placement fixed, not planned), at pipeline ``degrees``, chained; ``prepare(shard)`` runs
    before each is attached. In a spawned rank (imports inside)."""
    from ds_fssdp.moe.sharded import ShardedExperts, chain, default_context
    from ds_fssdp.planner import LoadPredictor
    E = layers[0].num_experts
    predictor = LoadPredictor([E] * len(layers))
    shards = []
    for i, (layer, (owner_E, placement_ED)) in enumerate(zip(layers, placements)):
        rows = layer.spec.flatten(layer.export_experts())[owner_E == rank]
        ctx = dataclasses.replace(default_context(E, topo, predictor, i)(), pipeline_degree=degrees)
        s = ShardedExperts(spec=layer.spec, layer_index=i, owner_E=owner_E, rows_SP=rows, topology=topo,
                           group=None, predictor=predictor, exchange=exchange, options=options,
                           context=lambda c=ctx: c)
        s.plan_placement = lambda ctx, p=placement_ED: (p, -1)
        if prepare is not None:
            prepare(s)
        layer.attach_sharded(s)
        shards.append(s)
    chain(shards)
    return shards


def rank_inputs(case: dict, rank: int, hidden: int) -> tuple:
    """This rank's tokens and the output gradient: ``case["tokens"][rank]`` rows of ``hidden``,
    seeded by the case and the rank."""
    gen = torch.Generator().manual_seed(1000 * case["seed"] + rank)
    T = case["tokens"][rank]
    return torch.randn(T, hidden, generator=gen), torch.randn(T, hidden, generator=gen)


def model_forward(layers, x, ckpt, shared=None):
    """The layers in sequence, their aux losses summed; ``ckpt``: None / False (plain), "torch" or
    True (non-reentrant activation checkpointing), "reentrant". ``shared``: a module per layer
    whose output on the layer's input is added to the layer's (a block's shared experts, called
    after them)."""
    def run(x):
        l_aux = 0.0
        for i, layer in enumerate(layers):
            y, aux, _ = layer(x)
            x = y if shared is None else y + shared[i](x)
            l_aux = l_aux + aux
        return x, l_aux
    if ckpt in ("torch", True):
        return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
    if ckpt == "reentrant":
        return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=True)
    return run(x)


def forward_backward(layers, shards, case: dict, rank: int, hidden: int) -> dict:
    """One forward and backward of the stacked layers on this rank's inputs (``case["ckpt"]``'s
    checkpointing), the replica gradients folded: the output, the input's, gates' and owned
    experts' gradients."""
    x, dy = rank_inputs(case, rank, hidden)
    x.requires_grad_(True)
    y, l_aux = model_forward(layers, x, case.get("ckpt"))
    ((y * dy).sum() + 0.1 * l_aux).backward()
    for s in shards:
        s.accumulate_grads()
    return dict(y=y.detach(), x_grad=x.grad, gate_grads=[l.gate.weight.grad for l in layers],
                owned=[(s.owned_E, s.master.grad.clone()) for s in shards])

"""The expert MLP over grouped rows, built from the grouped GEMM.

Legend: R rows, G local experts, H hidden, F expert FFN hidden.

non-gated (gelu):  y = act(x @ w_a[g] + b_a[g]) @ w_b[g] + b_b[g]          w_a [G,H,F], w_b [G,F,H]
gated (swiglu, geglu, geglu_tanh, swiglu_limit, gptoss):
                   y = act(x @ w_gate[g] + b_gate[g], x @ w_up[g] + b_up[g]) @ w_down[g] + b_down[g]
The biases (b_a, b_b / b_gate, b_up, b_down: [G, F] or [G, H]) are optional, each on its own;
``activations.py`` has the formulas and the transformers code each one matches. ``lora`` adds
LoRA updates to any of the projections (``lora.py``): ``x @ w[g]`` becomes
``x @ w[g] + scaling * (x @ a[g]) @ b[g]`` for each adapter given for that weight.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from ds_fssdp.ops import activations
from ds_fssdp.ops.group_sizes import GroupSizes, SizesLike
from ds_fssdp.ops.grouped_gemm import grouped_gemm
from ds_fssdp.ops.lora import LoraFactors, lora_delta


def expert_mlp(x_RH: torch.Tensor, weights: Mapping[str, torch.Tensor], group_sizes: SizesLike, *,
               activation: str, act_params: Optional[Mapping[str, float]] = None,
               lora: Optional[Mapping[str, Sequence[LoraFactors]]] = None) -> torch.Tensor:
    """y_RH for rows grouped by expert (``group_sizes`` as for ``grouped_gemm``). ``weights`` holds
    the activation's weights and any of their biases (``b_*``). The group sizes are converted once
    (host ints for torch, device offsets for Triton) and shared by every GEMM here and in the
    backward. ``lora``: LoRA factors by weight name (``w_gate``, ...), stacked like the weights."""
    params = activations.check(activation, act_params)
    names = [n for n, _ in activations.ACTIVATIONS[activation]]
    known = set(names) | {activations.bias_name(n) for n in names}
    missing = [n for n in names if n not in weights]
    unknown = [n for n in weights if n not in known]
    if missing or unknown:
        raise ValueError(f"expert_mlp({activation!r}) takes weights {names} and optional biases "
                         f"{[activations.bias_name(n) for n in names]}; missing {missing}, unknown {unknown}")
    lora = lora or {}
    if any(n not in names for n in lora):
        raise ValueError(f"expert_mlp({activation!r}): LoRA on {sorted(lora)}, but the weights are {names}")
    group_sizes = GroupSizes.of(group_sizes, num_groups=weights[names[0]].shape[0], num_rows=x_RH.shape[0])

    def proj(inp, name):
        y = grouped_gemm(inp, weights[name], group_sizes, bias=weights.get(activations.bias_name(name)))
        for factors in lora.get(name, ()):
            y = y + lora_delta(inp, factors, group_sizes)
        return y

    if activations.is_gated(activation):
        h_RF = activations.apply(activation, params, proj(x_RH, "w_gate"), proj(x_RH, "w_up"))
        return proj(h_RF, "w_down")
    return proj(activations.apply(activation, params, proj(x_RH, "w_a")), "w_b")

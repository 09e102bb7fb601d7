"""Fit a recorded trace to a larger cluster and model: more ranks, experts, layers, tokens.

Legend: S steps, L layers, E experts, D ranks; primes for the target.

* Ranks: target rank d' draws its assignments from the expert distribution of source rank
  d' mod D at the same step (its data looks like that rank's), ``assignments_per_rank`` of them
  (the model's tokens per GPU x top-k) as one multinomial draw, so ranks that share a source
  differ by sampling noise only.
* Experts (E' a multiple of E): each source expert splits into k = E' / E experts, its share
  divided equally (``split_concentration=None``) or by Dirichlet(alpha) weights fixed per layer
  for the whole trace; new expert ids are a seeded permutation per layer, so the siblings of a hot
  expert do not sit on neighbouring ranks (which would make node loads artificially skewed or,
  interleaved, artificially even). This keeps each expert's load relative to the mean, the
  quantity that makes stragglers, but divides the paper's skew measure (std of shares) by k.
* Layers: target layer l' replays source layer l' mod L, shifted by (l' div L) x ``layer_shift``
  steps (cyclically), so repeated layers are at different points of their drift.
Seeded: same arguments, same trace.
"""
from __future__ import annotations

import math

import numpy as np

from ds_fssdp.sim.traces import Trace


def remap_trace(trace: Trace, *, num_ranks: int, assignments_per_rank: int, num_experts: int | None = None,
                num_layers: int | None = None, split_concentration: float | None = None,
                layer_shift: int | None = None, seed: int = 0) -> Trace:
    S, L, E, D = trace.tokens_SLED.shape
    E2 = E if num_experts is None else num_experts
    L2 = L if num_layers is None else num_layers
    if num_ranks < 1 or assignments_per_rank < 0 or L2 < 1:
        raise ValueError(f"remap_trace needs num_ranks ({num_ranks}) >= 1, num_layers ({L2}) >= 1, "
                         f"assignments_per_rank ({assignments_per_rank}) >= 0")
    if E2 < E or E2 % E:
        raise ValueError(f"remap_trace num_experts ({E2}) must be a multiple of the trace's experts ({E})")
    if split_concentration is not None and split_concentration <= 0:
        raise ValueError(f"remap_trace split_concentration ({split_concentration}) must be > 0 or None")
    k = E2 // E
    shift = S // math.ceil(L2 / L) if layer_shift is None else layer_shift
    rng = np.random.default_rng(seed)
    w_LEK = (np.full((L2, E, k), 1.0 / k) if split_concentration is None else
             rng.dirichlet(np.full(k, split_concentration), size=(L2, E)))
    perm_LE = np.stack([rng.permutation(E2) for _ in range(L2)])  # new id of sub-expert (e, j) = perm[e*k + j]
    src_layer = np.arange(L2) % L
    step_offset = (np.arange(L2) // L) * shift
    src_rank = np.arange(num_ranks) % D
    tokens = np.empty((S, L2, E2, num_ranks), dtype=np.int32)
    rows = np.arange(L2)[:, None]
    for s in range(S):
        src_LED = trace.tokens_SLED[(s + step_offset) % S, src_layer].astype(np.float64)  # [L2, E, D]
        total_LD = src_LED.sum(1, keepdims=True)
        layer_LE = src_LED.sum(2, keepdims=True)
        share_LED = np.where(total_LD > 0, src_LED / np.maximum(total_LD, 1),
                             layer_LE / np.maximum(layer_LE.sum(1, keepdims=True), 1))
        sub_LEKD = share_LED[:, :, None, :] * w_LEK[..., None]
        split_LED = np.empty((L2, E2, D))
        split_LED[rows, perm_LE] = sub_LEKD.reshape(L2, E2, D)
        p_LDE = split_LED[:, :, src_rank].transpose(0, 2, 1)
        p_LDE = p_LDE / p_LDE.sum(-1, keepdims=True)
        tokens[s] = rng.multinomial(assignments_per_rank, p_LDE).transpose(0, 2, 1)
    meta = {
        "source": "remapped",
        "remap": {"from": {"steps": S, "num_layers": L, "num_experts": E, "num_ranks": D,
                           "source": trace.meta.get("file", trace.meta.get("source"))},
                  "split_concentration": split_concentration, "layer_shift": shift, "seed": seed},
        "top_k": trace.top_k, "assignments_per_rank": assignments_per_rank,
    }
    return Trace(tokens, meta)

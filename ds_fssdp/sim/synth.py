"""Synthetic routing traces: skewed, drifting expert loads with a chosen skew.

Legend: S steps, L layers, E experts, D ranks.

For when no recorded trace fits the cluster. Each layer has a latent preference z (L x E) that
drifts as a unit-variance Ornstein-Uhlenbeck process (step correlation 1 - ``drift``: slow drift
the load predictor can follow) mixed with a fraction ``jitter`` of fresh noise every step (what it
cannot). Gate shares are softmax(sigma z); each rank sees its own data, so its shares add
``rank_spread`` of independent logit noise; its ``assignments_per_rank`` assignments are a
multinomial draw from them. With ``top_k`` set, no expert takes more than 1/k of a rank's
assignments (a token picks k distinct experts).

sigma is found by bisection so that the skew, the std over experts of each expert's share of the
layer (paper Figure 16a: 0.034 to 0.046 for Qwen1.5-MoE on cluster B), averaged over steps and
layers, is ``target_std`` (calibrated on the expected shares of 24 steps spread over the trace; the
multinomial draw adds only sampling noise). Seeded: same arguments, same trace.
"""
from __future__ import annotations

import numpy as np

from ds_fssdp.sim.traces import Trace


def synthetic_trace(*, steps: int, num_layers: int, num_experts: int, num_ranks: int, assignments_per_rank: int,
                    target_std: float, drift: float = 0.005, jitter: float = 0.03, rank_spread: float = 0.2,
                    top_k: int | None = None, seed: int = 0) -> Trace:
    if steps < 1 or num_layers < 1 or num_experts < 2 or num_ranks < 1 or assignments_per_rank < 1:
        raise ValueError(f"synthetic_trace needs steps ({steps}), num_layers ({num_layers}), num_ranks ({num_ranks}), "
                         f"assignments_per_rank ({assignments_per_rank}) >= 1 and num_experts ({num_experts}) >= 2")
    if not 0 < drift <= 1 or not 0 <= jitter < 1 or rank_spread < 0:
        raise ValueError(f"synthetic_trace needs 0 < drift ({drift}) <= 1, 0 <= jitter ({jitter}) < 1, "
                         f"rank_spread ({rank_spread}) >= 0")
    cap = 1.0 / top_k if top_k else 1.0
    # Uniform shares have std 0; all load on one expert (or on k experts with the cap) is the max.
    max_std = _std_of_shares(_cap(np.eye(1, num_experts)[0][None], cap)[0][None, None])
    if not 0 <= target_std < max_std:
        raise ValueError(f"target_std ({target_std}) must be in [0, {max_std:.4f}) for {num_experts} experts"
                         f"{f' and top_k {top_k}' if top_k else ''}")
    rng = np.random.default_rng(seed)
    rho = 1.0 - drift
    z_SLE = np.empty((steps, num_layers, num_experts))
    u = rng.standard_normal((num_layers, num_experts))
    for s in range(steps):
        if s:
            u = rho * u + np.sqrt(1 - rho * rho) * rng.standard_normal(u.shape)
        z_SLE[s] = np.sqrt(1 - jitter * jitter) * u + jitter * rng.standard_normal(u.shape)
    noise_SLDE = rank_spread * rng.standard_normal((steps, num_layers, num_ranks, num_experts))

    def shares(sigma: float, sl) -> np.ndarray:  # [s, L, D, E]
        return _cap(_softmax(sigma * z_SLE[sl, :, None, :] + noise_SLDE[sl]), cap)

    calib = np.unique(np.linspace(0, steps - 1, min(steps, 24)).round().astype(int))

    def skew(sigma: float) -> float:
        return _std_of_shares(shares(sigma, calib).mean(2))

    sigma = bisect_sigma(skew, target_std)
    tokens_SLED = np.empty((steps, num_layers, num_experts, num_ranks), dtype=np.int32)
    for s in range(steps):
        p_LDE = shares(sigma, slice(s, s + 1))[0]
        tokens_SLED[s] = rng.multinomial(assignments_per_rank, p_LDE).transpose(0, 2, 1)
    meta = {
        "source": "synthetic",
        "synthetic": {"target_std": target_std, "sigma": sigma, "drift": drift, "jitter": jitter,
                      "rank_spread": rank_spread, "seed": seed},
        "top_k": top_k, "assignments_per_rank": assignments_per_rank,
    }
    return Trace(tokens_SLED, meta)


def bisect_sigma(skew, target: float) -> float:
    """The sigma at which the increasing function ``skew`` reaches ``target`` (doubling, then
    40 halvings)."""
    lo, hi = 0.0, 1.0
    while skew(hi) < target and hi < 1e3:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if skew(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = x - x.max(-1, keepdims=True)
    np.exp(e, out=e)
    e /= e.sum(-1, keepdims=True)
    return e


def _cap(p: np.ndarray, cap: float) -> np.ndarray:
    """Water-fill: clip shares at ``cap`` and hand the excess to the unclipped experts in
    proportion (repeated until nothing exceeds the cap). Only rows with a share over the cap
    take a round (a round leaves the others as they are: their excess is 0)."""
    if cap >= 1.0:
        return p
    rows = p.reshape(-1, p.shape[-1])
    idx = np.flatnonzero((rows > cap).any(-1))
    if idx.size:
        sub = rows[idx]
        for _ in range(p.shape[-1]):
            over = sub > cap
            if not over.any():
                break
            excess = np.where(over, sub - cap, 0).sum(-1, keepdims=True)
            sub = np.where(over, cap, sub)
            free = np.where(sub < cap, sub, 0)
            free_sum = free.sum(-1, keepdims=True)
            sub = sub + np.divide(free, free_sum, out=np.zeros_like(free), where=free_sum > 0) * excess
        rows = rows.copy()
        rows[idx] = sub
    return (rows / rows.sum(-1, keepdims=True)).reshape(p.shape)


def _std_of_shares(share_SLE: np.ndarray) -> float:
    return float(share_SLE.std(-1).mean())

"""Synthetic routing at a skew that means the same for any expert count, one step at a time.

Legend: S steps, L layers, E experts, D ranks.

Skew is the coefficient of variation (CV) of expert load: the std over a layer's experts of
their assignments divided by the mean, averaged over layers. The share std of
:mod:`ds_fssdp.sim.synth` shrinks as 1 / E (0.04 is mild at 8 experts and impossible at 1024); the
CV does not: with top-k routing an expert takes at most 1 / k of the assignments, so any CV in
[0, sqrt(E / k - 1)) can be asked for (0.5 is the shared recorded trace's, 8 experts top-2).

The routing model is :func:`~ds_fssdp.sim.synth.synthetic_trace`'s: a log-popularity per layer
and expert drifting across steps (AR(1), ``drift``), fresh ``jitter`` per step, per-rank noise
(``rank_spread``); shares are the capped softmax of sigma times that, sigma found by bisection
so that the expected CV of a layer's load (the shares averaged over 64 sample ranks at the first
step) is ``load_cv``; each rank's ``assignments_per_rank`` follow its shares by systematic
sampling (:func:`systematic_counts`).

The steps are generated as they are read (one step of DeepSeek-V3 on 4096 GPUs is 60 M counts; a
whole trace would not fit in memory): iterate the source once, in order. Seeded: the same
arguments give the same steps.
"""
from __future__ import annotations

import math

import numpy as np

from ds_fssdp.planner.prices import _fastplan  # the planner's C, None where not built
from ds_fssdp.sim.synth import _cap, _softmax, bisect_sigma

CALIBRATION_RANKS = 64


def load_cv(load_SLE: np.ndarray) -> float:
    """CV of expert load, averaged over steps and layers."""
    load_SLE = np.asarray(load_SLE, dtype=np.float64)
    mean_SL = load_SLE.mean(-1)
    cv_SL = np.divide(load_SLE.std(-1), mean_SL, out=np.zeros_like(mean_SL), where=mean_SL > 0)
    return float(cv_SL.mean())


class LoadCVSource:
    """Iterable of ``tokens_LED`` (int32 [L, E, D]), ``steps`` of them."""

    def __init__(self, *, steps: int, num_layers: int, num_experts: int, num_ranks: int, assignments_per_rank: int,
                 cv: float, top_k: int | None = None, drift: float = 0.005, jitter: float = 0.03,
                 rank_spread: float = 0.2, seed: int = 0):
        if min(steps, num_layers, num_ranks, assignments_per_rank) < 1 or num_experts < 2:
            raise ValueError(f"LoadCVSource needs steps ({steps}), num_layers ({num_layers}), num_ranks ({num_ranks}), "
                             f"assignments_per_rank ({assignments_per_rank}) >= 1 and num_experts ({num_experts}) >= 2")
        if not 0 < drift <= 1 or not 0 <= jitter < 1 or rank_spread < 0:
            raise ValueError(f"LoadCVSource needs 0 < drift ({drift}) <= 1, 0 <= jitter ({jitter}) < 1, "
                             f"rank_spread ({rank_spread}) >= 0")
        self.cap = 1.0 / top_k if top_k else 1.0
        max_cv = math.sqrt(num_experts * self.cap - 1.0) if top_k else math.sqrt(num_experts - 1.0)
        if not 0 <= cv < max_cv:
            raise ValueError(f"load_cv ({cv}) must be in [0, {max_cv:.3f}) for {num_experts} experts"
                             f"{f' and top_k {top_k}' if top_k else ''}")
        self.steps, self.num_layers, self.num_experts, self.num_ranks = steps, num_layers, num_experts, num_ranks
        self.assignments_per_rank, self.cv = assignments_per_rank, cv
        self.drift, self.jitter, self.rank_spread, self.seed = drift, jitter, rank_spread, seed
        z_LE = np.random.default_rng([seed, 0]).standard_normal((num_layers, num_experts))  # step 0's, as __iter__
        calib_rng = np.random.default_rng([seed, 1])
        noise_LRE = rank_spread * calib_rng.standard_normal((num_layers, min(num_ranks, CALIBRATION_RANKS),
                                                             num_experts))
        def skew(sigma: float) -> float:
            return load_cv(_cap(_softmax(sigma * z_LE[:, None] + noise_LRE), self.cap).mean(1))

        self.sigma = bisect_sigma(skew, cv)

    def meta(self) -> dict:
        return {"source": "synthetic", "synthetic": {"load_cv": self.cv, "sigma": self.sigma, "drift": self.drift,
                                                     "jitter": self.jitter, "rank_spread": self.rank_spread,
                                                     "seed": self.seed},
                "top_k": round(1 / self.cap) if self.cap < 1 else None,
                "assignments_per_rank": self.assignments_per_rank}

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        rng = np.random.default_rng([self.seed, 0])
        L, E, D = self.num_layers, self.num_experts, self.num_ranks
        rho = 1.0 - self.drift
        u_LE = rng.standard_normal((L, E))
        # one step's arrays, kept across steps (fresh ones of 60 M entries cost their page faults again)
        noise_LDE, edges_LDE = np.empty((L, D, E), dtype=np.float32), np.empty((L, D, E))
        cut_LDE, counts_LDE = np.empty((L, D, E), dtype=np.int32), np.empty((L, D, E), dtype=np.int32)
        for s in range(self.steps):
            if s:
                u_LE = rho * u_LE + math.sqrt(1 - rho * rho) * rng.standard_normal((L, E))
            z_LE = math.sqrt(1 - self.jitter**2) * u_LE + self.jitter * rng.standard_normal((L, E))
            rng.standard_normal(dtype=np.float32, out=noise_LDE)
            noise_LDE *= self.rank_spread
            noise_LDE += (self.sigma * z_LE[:, None, :]).astype(np.float32)
            p_LDE = _cap(_softmax(noise_LDE, out=noise_LDE), self.cap, out=noise_LDE)
            yield step_counts(p_LDE, self.assignments_per_rank, rng, out=(edges_LDE, cut_LDE, counts_LDE))


def step_counts(p_LDE: np.ndarray, n: int, rng: np.random.Generator, out: tuple | None = None) -> np.ndarray:
    """A step's ``tokens_LED`` (int32 [L, E, D]): :func:`systematic_counts` of each rank's float32
    shares, transposed; in C where it is built (``_fastplan.systematic_counts``: the same float64
    operations in one pass, the same rng draw). ``out``: systematic_counts' work arrays."""
    if _fastplan is None or p_LDE.dtype != np.float32:
        return systematic_counts(p_LDE, n, rng, out=out).transpose(0, 2, 1).copy()
    L, D, E = p_LDE.shape
    offsets = rng.random((L, D, 1))
    tokens_LED = np.empty((L, E, D), dtype=np.int32)
    _fastplan.systematic_counts(np.ascontiguousarray(p_LDE), offsets, tokens_LED, L, D, E, int(n))
    return tokens_LED


def systematic_counts(p_XE: np.ndarray, n: int, rng: np.random.Generator, out: tuple | None = None) -> np.ndarray:
    """int32 counts per row of ``p_XE`` summing to ``n``, each within one of ``n p`` (systematic
    sampling: one uniform offset per row). A multinomial draw costs five times as much at this
    size and adds only sampling noise to the rank noise already in ``p``. ``out``: (float64,
    int32, int32) arrays of ``p_XE``'s shape to work in, the last one returned."""
    edges_XE, cut_XE, counts_XE = out or (np.empty(p_XE.shape), np.empty(p_XE.shape, np.int32),
                                          np.empty(p_XE.shape, np.int32))
    np.copyto(edges_XE, p_XE)
    np.cumsum(edges_XE, axis=-1, out=edges_XE)
    edges_XE *= n / edges_XE[..., -1:]
    edges_XE += rng.random(p_XE.shape[:-1] + (1, ))  # floor(u) = 0 below the first edge: the counts sum to n
    np.copyto(cut_XE, edges_XE, casting="unsafe")  # floor: the edges are >= 0
    counts_XE[..., 0] = cut_XE[..., 0]
    np.subtract(cut_XE[..., 1:], cut_XE[..., :-1], out=counts_XE[..., 1:])
    return counts_XE

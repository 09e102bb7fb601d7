"""How well the sliding-window load predictor (paper section 4.2, w = 5) foresees a trace.

Legend: S steps, L layers, E experts.

The prediction for step s is the mean load of steps s - w .. s - 1, what
:class:`ds_fssdp.planner.LoadPredictor` returns after observing them. R^2 pools every (step, layer,
expert) with a full window (s >= w), as the paper's Figure 15b pools all experts and layers:
R^2 = 1 - sum (actual - predicted)^2 / sum (actual - mean actual)^2.
"""
from __future__ import annotations

import numpy as np


def predicted_loads(load_SLE: np.ndarray, window: int = 5) -> np.ndarray:
    """float64 [S - w, L, E]: the prediction for steps w .. S - 1."""
    load_SLE = np.asarray(load_SLE, dtype=np.float64)
    if window < 1:
        raise ValueError(f"window ({window}) must be >= 1")
    if load_SLE.shape[0] <= window:
        raise ValueError(f"a trace of {load_SLE.shape[0]} steps has no step with a full window of {window}")
    csum = np.concatenate([np.zeros_like(load_SLE[:1]), np.cumsum(load_SLE, 0)])
    return (csum[window:-1] - csum[:-window - 1]) / window


def prediction_r2(load_SLE: np.ndarray, window: int = 5, *, per_layer: bool = False):
    """R^2 of the window-``window`` moving average on ``load_SLE``; a list per layer if ``per_layer``."""
    load_SLE = np.asarray(load_SLE, dtype=np.float64)
    pred = predicted_loads(load_SLE, window)
    actual = load_SLE[window:]
    return [_r2(actual[:, l], pred[:, l]) for l in range(actual.shape[1])] if per_layer else _r2(actual, pred)


def _r2(actual: np.ndarray, pred: np.ndarray) -> float:
    ss_tot = float(((actual - actual.mean())**2).sum())
    ss_res = float(((actual - pred)**2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0

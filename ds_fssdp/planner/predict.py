"""Sliding-window load prediction (paper section 4.2: Themis averages the last w = 5 iterations).

Legend: L MoE layers, E experts, D ranks.
"""
from __future__ import annotations

from collections import deque

import torch


class LoadPredictor:
    """Per-layer mean of the last ``window`` observed expert loads.

    Every rank observes the same all-gathered counts, so every rank predicts the same loads and
    plans the same placement without exchanging plans.
    """

    def __init__(self, num_experts_L, window: int = 5):
        """``num_experts_L``: experts of each layer (a list), or one int for a single layer."""
        if window < 1:
            raise ValueError(f"LoadPredictor window ({window}) must be >= 1")
        self.num_experts_L = [num_experts_L] if isinstance(num_experts_L, int) else list(num_experts_L)
        self.num_layers = len(self.num_experts_L)
        self.window = window
        self._history = [deque(maxlen=window) for _ in range(self.num_layers)]

    def observe(self, layer: int, load_E: torch.Tensor) -> None:
        load_E = load_E.detach().to("cpu", torch.float64).reshape(-1)
        if load_E.numel() != self.num_experts_L[layer]:
            raise ValueError(f"layer {layer}: observed load has {load_E.numel()} experts, expected "
                             f"{self.num_experts_L[layer]}")
        self._history[layer].append(load_E)

    def predict(self, layer: int) -> torch.Tensor | None:
        """Predicted tokens per expert (float64 [E]), or None before the first observation."""
        hist = self._history[layer]
        if not hist:
            return None
        return torch.stack(list(hist)).mean(0)

    def predict_all(self) -> torch.Tensor | None:
        """Predicted loads of all layers (float64 [L, E]), or None if any layer lacks history."""
        preds = [self.predict(l) for l in range(self.num_layers)]
        if any(p is None for p in preds):
            return None
        return torch.stack(preds)

    def state_dict(self) -> dict:
        return {
            "window": self.window,
            "history": [torch.stack(list(h)) if h else torch.zeros(0, e, dtype=torch.float64)
                        for h, e in zip(self._history, self.num_experts_L)],
        }

    def load_state_dict(self, state: dict) -> None:
        for layer, rows in enumerate(state["history"]):
            self._history[layer].clear()
            for row in rows:
                self._history[layer].append(row.to(torch.float64))

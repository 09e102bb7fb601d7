"""Sliding-window load prediction (paper section 4.2: Themis averages the last w = 5 iterations).

Legend: L MoE layers, E experts, D ranks.
"""
from __future__ import annotations

from collections import deque

import torch


class LoadPredictor:
    """Per-layer mean of the last ``window`` observed expert loads.

    Every rank observes the same all-gathered counts, so every rank predicts the same loads and
    plans the same placement without exchanging plans. It also keeps its own error: the relative L1
    error of each prediction it made against the loads then observed (:meth:`error`, the mean of
    the last ``window``).
    """

    def __init__(self, num_experts_L, window: int = 5):
        """``num_experts_L``: experts of each layer (a list), or one int for a single layer."""
        if window < 1:
            raise ValueError(f"LoadPredictor window ({window}) must be >= 1")
        self.num_experts_L = [num_experts_L] if isinstance(num_experts_L, int) else list(num_experts_L)
        self.num_layers = len(self.num_experts_L)
        self.window = window
        self._history = [deque(maxlen=window) for _ in range(self.num_layers)]
        self._loads = [deque(maxlen=window) for _ in range(self.num_layers)]  # each observation's sum(1)
        self._errors = [deque(maxlen=window) for _ in range(self.num_layers)]

    def observe(self, layer: int, tokens: torch.Tensor) -> float:
        """Record one iteration: per-expert loads [E], or the all-gathered ``tokens_ED`` [E, D]
        (which also lets :meth:`predict_tokens` predict where the tokens come from). Returns the
        relative L1 error of the prediction it had for them (NaN: none, or no assignments)."""
        tokens = tokens.detach().to("cpu", torch.float64)
        if tokens.dim() == 1:
            tokens = tokens[:, None]
        if tokens.dim() != 2 or tokens.shape[0] != self.num_experts_L[layer]:
            raise ValueError(f"layer {layer}: observed load has {tokens.shape[0]} experts, expected "
                             f"{self.num_experts_L[layer]}")
        load_E = tokens.sum(1)
        error = relative_l1_error(self.predict(layer), load_E)
        if error == error:  # a prediction was made, and the iteration had assignments
            self._errors[layer].append(error)
        self._history[layer].append(tokens)
        self._loads[layer].append(load_E)
        return error

    def predict(self, layer: int) -> torch.Tensor | None:
        """Predicted tokens per expert (float64 [E]), or None before the first observation."""
        return _mean(self._loads[layer])

    def error(self, layer: int) -> float | None:
        """Mean relative L1 error (:func:`relative_l1_error`) of this layer's last ``window``
        predictions against the loads then observed; None before a prediction could be checked."""
        errors = self._errors[layer]
        return sum(errors) / len(errors) if errors else None

    def predict_tokens(self, layer: int) -> torch.Tensor | None:
        """Predicted ``tokens_ED`` (float64 [E, D]) if the window holds per-rank observations of
        one shape, else None."""
        hist = self._history[layer]
        return None if not hist or hist[0].shape[1] == 1 or any(h.shape != hist[0].shape for h in hist) else _mean(hist)

    def predict_all(self) -> torch.Tensor | None:
        """Predicted loads of all layers (float64 [L, E]), or None if any layer lacks history."""
        preds = [self.predict(l) for l in range(self.num_layers)]
        return None if any(p is None for p in preds) else torch.stack(preds)

    def state_dict(self) -> dict:
        return {"window": self.window, "history": [[h.clone() for h in hist] for hist in self._history],
                "errors": [list(errors) for errors in self._errors]}

    def load_state_dict(self, state: dict) -> None:
        for layer, rows in enumerate(state["history"]):
            self._history[layer].clear()
            self._loads[layer].clear()
            for row in rows:
                self._history[layer].append(row.to(torch.float64))
                self._loads[layer].append(self._history[layer][-1].sum(1))
        for layer, errors in enumerate(state.get("errors") or [[]] * self.num_layers):  # (older checkpoints: none)
            self._errors[layer].clear()
            self._errors[layer].extend(float(e) for e in errors)


def _mean(rows) -> torch.Tensor | None:
    """The mean of equal-shape float64 ``rows`` (a sum in order, then one division) without the
    stacked copy. Observations are counts, whose partial sums are exact, so it equals
    ``torch.stack(rows).mean(0)`` value for value (tests/test_predict.py). None for no rows."""
    if not rows:
        return None
    total = rows[0].clone()
    for row in list(rows)[1:]:
        total += row
    return total.div_(len(rows))


def relative_l1_error(predicted_E: torch.Tensor | None, actual_E: torch.Tensor) -> float:
    """Load-prediction error of one iteration: sum |predicted - actual| / sum actual over experts
    (0: perfect; half of it is the fraction of assignments the prediction put on the wrong
    experts). NaN without a prediction (the first iteration) or without assignments."""
    actual_E = actual_E.detach().to("cpu", torch.float64)
    total = float(actual_E.sum())
    if predicted_E is None or total <= 0:
        return float("nan")
    return float((predicted_E.to("cpu", torch.float64) - actual_E).abs().sum()) / total

"""A predictor that knows the iteration's loads: what the decisions cost when the prediction is
right, the what-if beside the sliding window (``python -m ds_fssdp.sim --predictor oracle``).

Legend: E experts, D ranks.

Not a policy and never the runtime's: the simulator tells it a layer's routed ``tokens_ED``
(:meth:`ForesightPredictor.foresee`) just before that layer's pre-gating, so the placement, its t
and its family are chosen on the loads they are then charged for; the layer's ``observe`` forgets
them again. Re-shards (``predict_all``, before any layer of the step) still see the window's mean,
as do layers not foreseen. Comparing a decision rule under both predictors separates what the rule
prices wrong from what the prediction misses.
"""
from __future__ import annotations

import torch

from ds_fssdp.planner.predict import LoadPredictor

PREDICTORS = ("window", "oracle")


class ForesightPredictor(LoadPredictor):
    """:class:`~ds_fssdp.planner.predict.LoadPredictor` whose per-layer predictions are the loads
    :meth:`foresee` was told, until that layer's :meth:`observe`."""

    def __init__(self, num_experts_L, window: int = 5):
        super().__init__(num_experts_L, window=window)
        self._foreseen = [None] * self.num_layers

    def foresee(self, layer: int, tokens_ED: torch.Tensor) -> None:
        """The loads ``layer`` is about to route ([E, D]); its predictions until the next observe."""
        tokens_ED = tokens_ED.detach().to("cpu", torch.float64)
        if tokens_ED.dim() != 2 or tokens_ED.shape[0] != self.num_experts_L[layer]:
            raise ValueError(f"layer {layer}: foreseen loads have shape {tuple(tokens_ED.shape)}, expected "
                             f"[{self.num_experts_L[layer]}, ranks]")
        self._foreseen[layer] = tokens_ED

    def observe(self, layer: int, tokens: torch.Tensor) -> float:
        error = super().observe(layer, tokens)
        self._foreseen[layer] = None
        return error

    def predict(self, layer: int) -> torch.Tensor | None:
        foreseen = self._foreseen[layer]
        return super().predict(layer) if foreseen is None else foreseen.sum(1)

    def predict_tokens(self, layer: int) -> torch.Tensor | None:
        foreseen = self._foreseen[layer]
        return super().predict_tokens(layer) if foreseen is None else foreseen.clone()


def make_predictor(kind: str, num_experts_L, *, window: int) -> LoadPredictor:
    """``kind``: "window" (the runtime's sliding window) or "oracle" (:class:`ForesightPredictor`)."""
    if kind not in PREDICTORS:
        raise ValueError(f"predictor ({kind!r}) must be one of {PREDICTORS}")
    return (ForesightPredictor if kind == "oracle" else LoadPredictor)(num_experts_L, window=window)

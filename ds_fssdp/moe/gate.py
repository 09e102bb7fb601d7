"""Top-k softmax gate: routing, the GShard/Switch auxiliary loss, z-loss and aux-loss-free bias.

Legend: T tokens, H hidden, E experts, K top-k.

* probabilities: softmax in fp32 over ``x @ W^T`` (``gate.weight`` [E, H], no bias);
* selection: top-k of the probabilities (plus ``expert_bias`` when the DeepSeek-style
  aux-loss-free balancing is on: the bias moves selection only, never the weights). The gate
  only reads the bias, like an HF router its ``e_score_correction_bias``: ``FSSDPMoE`` binds it
  to its experts module, whose one routing-bias rule moves it after each optimizer step;
* weights: the selected probabilities, renormalised to sum to 1 when k > 1 and ``normalize_topk``;
* ``l_aux = E * sum_e f_e * P_e`` with f_e the fraction of this rank's assignments routed to e and
  P_e the mean probability of e (1.0 at perfect balance), plus ``z_loss_coef * mean(logsumexp^2)``.

Dropless: every assignment is kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GateOutput:
    idx_TK: torch.Tensor  # long: chosen experts
    weights_TK: torch.Tensor  # fp32: combine weights
    l_aux: torch.Tensor  # fp32 scalar
    counts_E: torch.Tensor  # long: this rank's assignments per expert


class TopKGate(nn.Module):

    def __init__(self, hidden_size: int, num_experts: int, k: int, *, normalize_topk: bool = True,
                 z_loss_coef: float = 0.0, aux_free_bias: bool = False, device=None, dtype=None):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k ({k}) must be between 1 and num_experts ({num_experts})")
        self.num_experts = num_experts
        self.k = k
        self.normalize_topk = normalize_topk
        self.z_loss_coef = z_loss_coef
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        if aux_free_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x_TH: torch.Tensor) -> GateOutput:
        logits_TE = F.linear(x_TH.float(), self.weight.float())
        probs_TE = torch.softmax(logits_TE, dim=-1)
        scores_TE = probs_TE if self.expert_bias is None else probs_TE + self.expert_bias
        idx_TK = torch.topk(scores_TE.detach(), self.k, dim=-1, sorted=True).indices
        weights_TK = probs_TE.gather(1, idx_TK)
        if self.k > 1 and self.normalize_topk:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        counts_E = torch.bincount(idx_TK.reshape(-1), minlength=self.num_experts)
        num_tokens = x_TH.shape[0]
        if num_tokens == 0:
            l_aux = logits_TE.sum() * 0.0
        else:
            frac_E = counts_E.float() / float(num_tokens * self.k)
            l_aux = self.num_experts * (frac_E * probs_TE.mean(0)).sum()
            if self.z_loss_coef:
                l_aux = l_aux + self.z_loss_coef * torch.logsumexp(logits_TE, -1).pow(2).mean()
        return GateOutput(idx_TK=idx_TK, weights_TK=weights_TK, l_aux=l_aux, counts_E=counts_E)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints from before the one routing-bias rule carry the gate's own load accumulator
        # (zero after every optimizer step, when checkpoints are written); it is gone.
        state_dict.pop(prefix + "pending_load", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def uniform_assignment(gate: GateOutput, num_experts: int, *, rank: int) -> GateOutput:
    """The ``uniform`` policy's routing: assignment a of rank ``rank`` (inside its FSSDP group) goes
    to expert (a + rank) mod E, so every expert gets the same number of rows (the no-straggler
    speed reference) and the remainder lands as ``planner.baselines.ep.uniform_split`` counts it.
    The combine weights stay the gate's, so gradients still flow; what the model computes changes."""
    T, K = gate.idx_TK.shape
    idx_TK = ((torch.arange(T * K, device=gate.idx_TK.device) + rank) % num_experts).view(T, K)
    counts_E = torch.bincount(idx_TK.reshape(-1), minlength=num_experts)
    return GateOutput(idx_TK=idx_TK, weights_TK=gate.weights_TK, l_aux=gate.l_aux, counts_E=counts_E)

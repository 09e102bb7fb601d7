"""``ds_fssdp.MoE``: a drop-in for ``deepspeed.moe.layer.MoE`` that trains under FSSDP (README,
"Coming from DeepSpeed MoE").

Legend: T tokens, H hidden, F expert FFN hidden, E experts, K top-k.

Same constructor, same RNG draws at construction (same seed: the same initial weights as
DeepSpeed's layer: every expert a copy of the template, the gate an ``nn.Linear(H, E,
bias=False)``, ``coefficient`` for ``use_residual``), same ``forward(hidden_states)`` and triple.
The gate reproduces ``deepspeed.moe.sharded_moe.TopKGate`` exactly, dropless:

* logits ``x.float() @ wg^T``; fp32 softmax; ``noisy_gate_policy`` ``"Jitter"`` / ``"RSample"`` (in
  training) with DeepSpeed's own noise functions;
* k = 1: the argmax expert, its unnormalised probability; ``l_aux = E * sum_e me_e * ce_e``;
* k = 2: argmax, then the argmax of the logits (Gumbel-noised when ``top2_2nd_expert_sampling``, in
  training and eval alike) without the first, renormalised; ``l_aux = E^2 * mean_e(me_e * ce_e)``,
  ``ce`` counting first choices only (DeepSpeed's definition);
* k > 2: top-k, renormalised; ``l_aux = E^2 / k * mean_e(me_e * ce_e)``;
* ``exp_counts``: assignments per expert; top-1's random token selection draws DeepSpeed's random
  numbers (later draws stay aligned) although dropless makes it moot.

So with the same weights and RNG state the outputs, ``l_aux``, ``exp_counts`` and all gradients
equal DeepSpeed's layer with ``drop_tokens=False`` (fp32 summation order). ``ep_size=N`` is the
FSSDP group size; the capacity and token-dropping arguments, ``use_rts``, ``use_tutel`` and
``enable_expert_tensor_parallelism`` are moot under FSSDP (accepted, logged once).

Expert templates: ``nn.Sequential(nn.Linear(H, F), nn.GELU(), nn.Linear(F, H))`` with exact-erf
GELU. The first bias rides in the expert's first matrix on a constant-one input column (the experts
take [x, 1], the gate sees x; the matching output column of the second matrix is zero and gets
exactly zero gradient); the second is a dense ``[E, H]`` parameter added as ``sum_k w_k * b2[e_k]``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.moe.sharded_moe import gumbel_rsample, multiplicative_jitter
from deepspeed.utils import log_dist

from ds_fssdp.moe.gate import GateOutput, TopKGate
from ds_fssdp.moe.layer import FSSDPMoE

_LOGGED = set()


class DeepSpeedTopKGate(TopKGate):
    """``deepspeed.moe.sharded_moe.TopKGate``'s routing (dropless) behind FSSDP's gate interface.

    ``forward(x_TH)`` reads the first ``hidden_size`` columns of x (the layer may append a
    constant-one column for expert biases) and keeps its output in ``last`` for the layer."""

    def __init__(self, hidden_size: int, num_experts: int, k: int, *, noisy_gate_policy: Optional[str],
                 top2_2nd_expert_sampling: bool, rts_draw: bool, device=None, dtype=None):
        super().__init__(hidden_size, num_experts, k, device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.noisy_gate_policy = noisy_gate_policy
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.rts_draw = rts_draw
        self.last = None

    def forward(self, x_TH: torch.Tensor) -> GateOutput:
        x_TH = x_TH[:, :self.hidden_size].float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x_TH = multiplicative_jitter(x_TH, device=x_TH.device)
        logits_TE = F.linear(x_TH, self.weight.float())
        probs_TE = F.softmax(logits_TE, dim=1)
        E, T = self.num_experts, x_TH.shape[0]
        me_E = probs_TE.mean(0)
        if self.k == 1:
            rsample = self.noisy_gate_policy == "RSample" and self.training
            select_TE = logits_TE + gumbel_rsample(logits_TE.shape, device=logits_TE.device) if rsample else probs_TE
            idx_TK = torch.argmax(select_TE, dim=1, keepdim=True)
            weights_TK = probs_TE.gather(1, idx_TK)
            ce_E = F.one_hot(idx_TK[:, 0], E).float().mean(0)
            l_aux = (me_E * ce_E).sum() * E
            if self.rts_draw:
                # DeepSpeed's random token selection draws uniform [T, E]; it cannot drop anything
                # at dropless capacity, but drawing keeps the RNG stream aligned with DeepSpeed's.
                torch.rand((T, E), dtype=torch.float32, device=logits_TE.device)
        elif self.k == 2:
            idx1_T = torch.argmax(probs_TE, dim=1)
            mask1_TE = F.one_hot(idx1_T, E)
            second_TE = logits_TE + gumbel_rsample(logits_TE.shape, device=logits_TE.device) \
                if self.top2_2nd_expert_sampling else logits_TE
            idx2_T = torch.argmax(second_TE.masked_fill(mask1_TE.bool(), float("-inf")), dim=1)
            idx_TK = torch.stack([idx1_T, idx2_T], dim=1)
            g_TK = probs_TE.gather(1, idx_TK)
            weights_TK = g_TK / torch.clamp(g_TK.sum(1, keepdim=True), min=torch.finfo(g_TK.dtype).eps)
            l_aux = torch.mean(me_E * mask1_TE.float().mean(0)) * E * E
        else:
            top_TK, idx_TK = torch.topk(probs_TE, self.k, dim=1)
            weights_TK = top_TK / torch.clamp(top_TK.sum(1, keepdim=True), min=torch.finfo(top_TK.dtype).eps)
            mask_TE = torch.zeros_like(probs_TE).scatter_(1, idx_TK, 1.0)
            l_aux = torch.mean(me_E * mask_TE.mean(0)) * E * E / self.k
        counts_E = torch.bincount(idx_TK.reshape(-1), minlength=E)
        self.last = GateOutput(idx_TK=idx_TK, weights_TK=weights_TK, l_aux=l_aux, counts_E=counts_E)
        return self.last


def parse_expert_template(expert: nn.Module, hidden_size: int) -> tuple:
    """``(first Linear, second Linear)`` of a ``Linear(H, F) -> GELU() -> Linear(F, H)`` template."""
    is_mlp = (isinstance(expert, nn.Sequential) and len(expert) == 3 and isinstance(expert[0], nn.Linear)
                and isinstance(expert[2], nn.Linear))
    if is_mlp:
        first, act, second = expert
        if type(act) is not nn.GELU or act.approximate != "none":
            raise ValueError(f"ds_fssdp.MoE: expert activation {act!r} is not supported; FSSDP experts use the "
                             "exact-erf nn.GELU() (or swiglu through FSSDPMoE)")
        if (first.in_features, second.out_features, second.in_features) != (hidden_size, hidden_size,
                                                                            first.out_features):
            raise ValueError(f"ds_fssdp.MoE: expert template {expert!r} does not map hidden_size ({hidden_size}) -> "
                             "F -> hidden_size")
        return first, second
    raise ValueError(f"ds_fssdp.MoE: expert template {type(expert).__name__} is not supported: FSSDP maps "
                     "nn.Sequential(nn.Linear(hidden_size, F), nn.GELU(), nn.Linear(F, hidden_size)) "
                     f"(biases optional); got {expert!r}")


class MoE(nn.Module):
    """Drop-in for ``deepspeed.moe.layer.MoE`` (same constructor, same ``forward`` triple)."""

    # DeepSpeed's positional order is kept on purpose: callers pass these positionally.
    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: Optional[int] = None,
                 k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"ds_fssdp.MoE: noisy_gate_policy ({noisy_gate_policy!r}) must be None, 'None', "
                             "'Jitter' or 'RSample'")
        first, second = parse_expert_template(expert, hidden_size)
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        if ep_size is not None and (not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1):
            raise ValueError(f"ds_fssdp.MoE: ep_size ({ep_size!r}) must be an int >= 1 (the FSSDP group size) or None")
        self.ep_size = ep_size
        self.fssdp_group_size = ep_size  # read by ds_fssdp.initialize (fssdp.group_size)
        self.num_local_experts = num_experts  # every rank can compute every expert under FSSDP
        self.k = k
        self.use_residual = use_residual
        _log_moot_once(capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor,
                       min_capacity=min_capacity, drop_tokens=drop_tokens, use_rts=use_rts, use_tutel=use_tutel,
                       enable_expert_tensor_parallelism=enable_expert_tensor_parallelism)

        w1, b1, w2, b2 = first.weight, first.bias, second.weight, second.bias
        ffn = first.out_features
        self._bias_column = b1 is not None
        width = hidden_size + int(self._bias_column)
        # FSSDPMoE's own initialisation runs on the meta device (no RNG draw); its tensors are the
        # template's, copied to every expert as deepspeed.moe.experts.Experts deep-copies it.
        moe = FSSDPMoE(hidden_size=width, ffn_hidden_size=ffn, num_experts=num_experts, k=k, activation="gelu",
                       device="meta", dtype=w1.dtype)
        with torch.no_grad():
            w_a = torch.cat([w1.t(), b1.unsqueeze(0)], dim=0) if b1 is not None else w1.t()
            w_b = torch.cat([w2.t(), w2.new_zeros(ffn, 1)], dim=1) if b1 is not None else w2.t()
            moe.w_a = nn.Parameter(w_a.unsqueeze(0).repeat(num_experts, 1, 1).to(w1.device))
            moe.w_b = nn.Parameter(w_b.unsqueeze(0).repeat(num_experts, 1, 1).to(w1.device))
        # The same draw as deepspeed's TopKGate.wg, then (use_residual) its coefficient Linear.
        wg = nn.Linear(hidden_size, num_experts, bias=False).to(device=w1.device, dtype=w1.dtype)
        moe.gate = DeepSpeedTopKGate(hidden_size, num_experts, k,
                                     noisy_gate_policy=None if noisy_gate_policy == "None" else noisy_gate_policy,
                                     top2_2nd_expert_sampling=top2_2nd_expert_sampling, rts_draw=use_rts,
                                     device=w1.device, dtype=w1.dtype)
        with torch.no_grad():
            moe.gate.weight.copy_(wg.weight)
        self.moe = moe
        self.expert_bias = None if b2 is None else nn.Parameter(b2.detach().unsqueeze(0).repeat(num_experts, 1))
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """No-op: FSSDP needs no expert-parallel groups (kept for code that calls it)."""

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        if used_token is not None:
            raise ValueError("ds_fssdp.MoE: used_token is not supported (FSSDP routes every token)")
        x = hidden_states
        if self._bias_column:
            x = torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)
        out, l_aux, exp_counts = self.moe(x)
        if self._bias_column:
            out = out[..., :self.hidden_size]
        if self.expert_bias is not None:
            g = self.moe.gate.last
            bias_TH = (g.weights_TK.unsqueeze(-1) * self.expert_bias[g.idx_TK].to(g.weights_TK.dtype)).sum(1)
            out = out + bias_TH.to(out.dtype).reshape(out.shape)
        if self.use_residual:
            out_mlp = self.mlp(hidden_states)
            if isinstance(out_mlp, tuple):
                out_mlp = out_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            out = out * coef[..., 0:1] + out_mlp * coef[..., 1:]
        return out, l_aux, exp_counts


def _log_moot_once(**args) -> None:
    text = ", ".join(f"{k}={v!r}" for k, v in args.items())
    if text in _LOGGED:
        return
    _LOGGED.add(text)
    log_dist(f"ds_fssdp.MoE: FSSDP places experts itself and never drops tokens, so these deepspeed MoE "
             f"arguments have no effect: {text}", ranks=[0])


__all__ = ["MoE", "DeepSpeedTopKGate", "parse_expert_template"]

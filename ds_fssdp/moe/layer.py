"""FSSDPMoE: a dropless top-k MoE layer whose experts train under FSSDP once distributed.

Legend: T tokens, H hidden, F expert FFN hidden, E experts, K top-k.

The layer is our gate (:class:`TopKGate`) in front of :class:`FSSDPExperts`, the experts half
(which it is: a subclass), so its expert parameters keep their names (``w_a`` [E, H, F] and
``w_b`` [E, F, H] for gelu; ``w_gate``, ``w_up`` [E, H, F] and ``w_down`` [E, F, H] for the gated
activations; ``bias=True`` adds ``b_*`` per-expert biases, zero at init; ``act_params`` the
constants of the clamped activations) and ``ds_fssdp.initialize`` shards it like any experts module.

``lazy_experts=True`` builds the expert tensors on the meta device: no rank allocates them, and
``ds_fssdp.initialize`` draws each rank's own experts only (:meth:`fresh_rows`). Each expert's
tensors come from a generator seeded by the layer's ``init_seed`` (drawn from torch's global
generator at construction, so ``torch.manual_seed`` fixes it) and the expert, so the same weights
come out at every world and group size; :meth:`materialize_experts` draws all of them in one
process, the single-process reference. Without it the experts are drawn at construction from the
global generator, as before (every rank builds the same, and ``initialize`` keeps rank 0's).

``forward(x)`` with x [..., H] returns ``(out, l_aux, exp_counts)`` like
``deepspeed.moe.layer.MoE``: out = sum_k weight_k * expert_{e_k}(x).

``aux_free_bias=True`` gives the gate a selection bias (DeepSeek-V3's auxiliary-loss-free
balancing), bound like an HF router's ``e_score_correction_bias``: the experts module's routing-
bias rule moves it after every optimizer step by ``bias_update_rate`` (or by
``fssdp.router_bias_update_rate`` when the config sets it: the config's rate is every bound
bias's) times sign(mean load - expert load).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.moe.experts_module import FSSDPExperts
from ds_fssdp.moe.gate import TopKGate


class FSSDPMoE(FSSDPExperts):

    def __init__(self, *, hidden_size: int, ffn_hidden_size: int, num_experts: int, k: int = 2,
                 activation: str = "gelu", normalize_topk: bool = True, z_loss_coef: float = 0.0,
                 aux_free_bias: bool = False, bias_update_rate: float = 1e-3, init_std: float = 0.02,
                 bias: bool = False, act_params=None, device=None, dtype=None, lazy_experts: bool = False):
        spec = ExpertSpec(activation, hidden_size, ffn_hidden_size, bias=bias, act_params=act_params)
        super().__init__(spec=spec, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                         num_experts=num_experts, device="meta" if lazy_experts else device, dtype=dtype)
        self.init_std = float(init_std)
        # Per layer, fixed by torch.manual_seed; drawn only when lazy (a layer built whole draws
        # from the global generator exactly as it always did).
        self.init_seed = int(torch.randint(0, 2**62, ())) if lazy_experts else None
        self.k = k
        self.gate = TopKGate(hidden_size, num_experts, k, normalize_topk=normalize_topk, z_loss_coef=z_loss_coef,
                             aux_free_bias=aux_free_bias, device=device, dtype=dtype)
        if self.gate.expert_bias is not None:
            self.bind_router_bias(self.gate, "expert_bias", where="gate.expert_bias", update_rate=bias_update_rate)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate.weight, std=self.init_std)
        if self.sharded is None and self.owned is None and not self.lazy:
            for name in self.spec.names:
                # Weights normal, expert biases (b_*) zero, as nn.Linear users expect of a fresh layer.
                init = nn.init.zeros_ if name.startswith("b_") else (lambda t: nn.init.normal_(t, std=self.init_std))
                init(getattr(self, name))

    @torch.no_grad()
    def fresh_rows(self, owned_E: torch.Tensor) -> torch.Tensor:
        """Rows [S, P] of the experts ``owned_E`` of a lazy layer: weights normal(0, init_std),
        expert biases (b_*) zero; expert e's from its own generator."""
        if self.init_seed is None:
            raise RuntimeError("FSSDPMoE.fresh_rows: only a layer built with lazy_experts=True draws per expert")
        dtype = self._parameters[self.spec.names[0]].dtype
        rows_SP = torch.empty(owned_E.numel(), self.spec.numel, dtype=dtype)
        for s, e in enumerate(owned_E.tolist()):
            gen = torch.Generator().manual_seed(expert_seed(self.init_seed, e))
            views = self.spec.views(rows_SP[s:s + 1])
            for name in self.spec.names:
                if name.startswith("b_"):
                    views[name].zero_()
                else:
                    views[name].normal_(0.0, self.init_std, generator=gen)
        return rows_SP

    def forward(self, x: torch.Tensor):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"input last dim {x.shape[-1]} != hidden_size {self.hidden_size}")
        x_TH = x.reshape(-1, self.hidden_size)
        gate = self.gate(x_TH)
        out_TH = self.route_and_compute(x_TH, gate.idx_TK, gate.weights_TK, gate.counts_E)
        return out_TH.reshape(x.shape), gate.l_aux, gate.counts_E


def expert_seed(layer_seed: int, expert: int) -> int:
    """The seed of expert ``expert``'s initial values in a layer seeded ``layer_seed``."""
    return (layer_seed * 0x9E3779B1 + 0x632BE5AB * (expert + 1)) % (2**63 - 1)

"""FSSDPMoE: a dropless top-k MoE layer whose experts train under FSSDP once distributed.

Legend: T tokens, H hidden, F expert FFN hidden, E experts, K top-k.

Before ``ds_fssdp.initialize`` (and on one rank) the layer is an ordinary module holding every
expert as a [E, ...] parameter (``w_a`` [E, H, F] and ``w_b`` [E, F, H] for gelu; ``w_gate``,
``w_up`` [E, H, F] and ``w_down`` [E, F, H] for swiglu), so a model can be built, inspected and
converted before it is distributed. ``initialize`` replaces those parameters by a
:class:`ShardedExperts` holding only the experts this rank owns.

``forward(x)`` with x [..., H] returns ``(out, l_aux, exp_counts)`` like
``deepspeed.moe.layer.MoE``: out = sum_k weight_k * expert_{e_k}(x).
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from ds_fssdp.moe.compute import dispatch_compute_combine, local_exchange, mlp_fn
from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.moe.gate import TopKGate
from ds_fssdp.moe.routing import route


class FSSDPMoE(nn.Module):

    def __init__(self, *, hidden_size: int, ffn_hidden_size: int, num_experts: int, k: int = 2,
                 activation: str = "gelu", normalize_topk: bool = True, z_loss_coef: float = 0.0,
                 aux_free_bias: bool = False, bias_update_rate: float = 1e-3, init_std: float = 0.02, device=None,
                 dtype=None):
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts ({num_experts}) must be >= 1")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.num_experts = num_experts
        self.k = k
        self.spec = ExpertSpec(activation, hidden_size, ffn_hidden_size)
        self.gate = TopKGate(hidden_size, num_experts, k, normalize_topk=normalize_topk, z_loss_coef=z_loss_coef,
                             aux_free_bias=aux_free_bias, bias_update_rate=bias_update_rate, device=device,
                             dtype=dtype)
        for name, shape in self.spec.shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(num_experts, *shape, device=device,
                                                                   dtype=dtype)))
        self.sharded = None
        self._local_stats = {}
        self.reset_parameters(init_std)

    @property
    def activation(self) -> str:
        return self.spec.activation

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate.weight, std=std)
        if self.sharded is None:
            for name in self.spec.names:
                nn.init.normal_(getattr(self, name), std=std)

    def forward(self, x: torch.Tensor):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"input last dim {x.shape[-1]} != hidden_size {self.hidden_size}")
        x_TH = x.reshape(-1, self.hidden_size)
        gate = self.gate(x_TH)
        if self.sharded is None:
            out_TH = self._local_forward(x_TH, gate)
            load_E = gate.counts_E
        else:
            out_TH, tokens_ED = self.sharded.forward(x_TH, gate, observe=self.training)
            load_E = tokens_ED.sum(1)
        if self.training:
            self.gate.accumulate_load(load_E)
        return out_TH.reshape(x.shape), gate.l_aux, gate.counts_E

    def _local_forward(self, x_TH, gate):
        counts_E = gate.counts_E.cpu()
        r = route(gate.idx_TK, counts_E.view(-1, 1, 1), rank=0, local_E=torch.arange(self.num_experts))
        weights = {name: getattr(self, name) for name in self.spec.names}
        self._local_stats = {"replicas": 0, "expert_bytes": self.spec.numel * self.gate.weight.element_size(),
                             "gather_bytes": 0, "reduce_bytes": 0, "tokens_per_rank": [int(counts_E.sum())],
                             "straggler": 1.0, "ep_straggler": 1.0}
        return dispatch_compute_combine(x_TH, gate.weights_TK, r, expert_fn=mlp_fn(weights, self.activation),
                                        exchange=local_exchange)

    @property
    def last_stats(self) -> dict:
        """Statistics of the last iteration: ``replicas`` (|P' \\ P|), ``expert_bytes`` (Psi),
        ``gather_bytes`` / ``reduce_bytes`` (group totals of the sparse collectives),
        ``tokens_per_rank`` (rows computed per rank), ``straggler`` (max / mean of those rows) and
        ``ep_straggler`` (the same for the shard placement alone)."""
        return dict(self.sharded.stats) if self.sharded is not None else dict(self._local_stats)

    def attach_sharded(self, sharded) -> None:
        """Hand the experts to a :class:`ShardedExperts` (called by ``ds_fssdp.initialize``)."""
        for name in self.spec.names:
            del self._parameters[name]
        self.sharded = sharded

    def expert_parameters(self) -> list:
        """The full expert parameters while the layer is not sharded (else [])."""
        return [] if self.sharded is not None else [getattr(self, n) for n in self.spec.names]

    @torch.no_grad()
    def export_experts(self) -> dict:
        """Full expert tensors by name ([E, ...]) on every rank; collective once sharded."""
        if self.sharded is None:
            return {name: getattr(self, name).detach().clone() for name in self.spec.names}
        views = self.spec.views(self.sharded.export_rows())
        return {name: v.clone() for name, v in views.items()}

    @torch.no_grad()
    def import_experts(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load full expert tensors by name; once sharded, each rank keeps the experts it owns."""
        for name, shape in self.spec.shapes.items():
            if name not in tensors:
                raise KeyError(f"import_experts: missing {name!r} (expected {list(self.spec.names)})")
            if tuple(tensors[name].shape) != (self.num_experts, *shape):
                raise ValueError(f"import_experts: {name} has shape {tuple(tensors[name].shape)}, expected "
                                 f"{(self.num_experts, *shape)}")
        if self.sharded is None:
            for name in self.spec.names:
                getattr(self, name).copy_(tensors[name])
        else:
            self.sharded.load_rows(self.spec.flatten(tensors))

    @torch.no_grad()
    def update_routing_bias(self) -> None:
        """Apply the aux-loss-free bias update (no-op without it). ``ds_fssdp``'s engine calls this
        after every optimizer step; single-process training calls it after ``optimizer.step()``."""
        self.gate.update_bias()

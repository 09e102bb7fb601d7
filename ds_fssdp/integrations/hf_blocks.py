"""The module that stands in for one Hugging Face sparse MoE block, and the table of HF families.

Legend: T tokens, H hidden, I expert FFN hidden (HF's ``moe_intermediate_size`` /
``intermediate_size``), E experts, K top-k.

transformers 5.x keeps a block's experts fused: ``experts.gate_up_proj`` [E, 2I, H] (gate rows
first, then up rows; applied as ``x @ W^T``) and ``experts.down_proj`` [E, H, I]; one expert is
``down(act(gate(x)) * up(x))``. FSSDPMoE's swiglu expert is
``(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]`` with ``w_gate``, ``w_up`` [E, H, I] and
``w_down`` [E, I, H], so the mapping is exact transposes:

    w_gate = gate_up_proj[:, :I, :]^T     w_up = gate_up_proj[:, I:, :]^T     w_down = down_proj^T

Routing is the HF router module itself, kept under its HF name (``gate``): it computes what HF
computes (logits in the model's dtype, fp32 softmax, top-k, the family's renormalisation and
cast), and HF's output recorder still captures its logits, so ``output_router_logits`` and the
model's own ``load_balancing_loss_func`` add the auxiliary loss exactly as in the original model.
Only the expert compute (and, once sharded, the experts' storage and training) moves to FSSDP.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_fssdp.moe.gate import GateOutput
from ds_fssdp.moe.layer import FSSDPMoE


@dataclass(frozen=True)
class Family:
    model_type: str
    module: str  # the transformers module defining the block
    block: str  # class name of the sparse MoE block
    shared_expert: bool  # Qwen2-MoE: a dense shared expert behind a sigmoid gate
    jitter: bool  # Mixtral: multiplicative router jitter on the block input in training

    def block_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.block)


FAMILIES = (
    Family("mixtral", "transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock", False, True),
    Family("qwen2_moe", "transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", True, False),
    Family("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", False, False),
    Family("olmoe", "transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock", False, False),
)

# The layout flags transformers' ``use_experts_implementation`` sets on an experts module, and the
# values the mapping above assumes.
_EXPERT_LAYOUT = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True,
                  "has_post_expert_norm": False, "_is_expert_parallel": False}


class RouterGate(nn.Module):
    """FSSDPMoE's gate interface over an HF router ``(logits, scores_TK, index_TK) = router(x_TH)``.

    The router is not registered here (the block registers it as ``gate``, HF's name), so its
    weight appears once in ``parameters()`` and ``state_dict()``. ``l_aux`` is zero: the HF model
    computes its own auxiliary loss from the recorded router logits."""

    def __init__(self, router: nn.Module, num_experts: int):
        super().__init__()
        object.__setattr__(self, "_router", router)
        self.num_experts = num_experts

    @property
    def weight(self) -> torch.Tensor:
        return self._router.weight

    def forward(self, x_TH: torch.Tensor) -> GateOutput:
        _, scores_TK, idx_TK = self._router(x_TH)
        counts_E = torch.bincount(idx_TK.reshape(-1), minlength=self.num_experts)
        return GateOutput(idx_TK=idx_TK, weights_TK=scores_TK, l_aux=x_TH.new_zeros((), dtype=torch.float32),
                          counts_E=counts_E)

    def accumulate_load(self, load_E: torch.Tensor) -> None:
        pass  # no aux-loss-free bias on HF routers

    def update_bias(self) -> None:
        pass


def check_experts(experts: nn.Module, where: str) -> None:
    """Refuse an experts module whose math the mapping does not reproduce exactly."""
    for flag, expected in _EXPERT_LAYOUT.items():
        value = getattr(experts, flag, expected)
        if value != expected:
            raise ValueError(f"{where}: experts.{flag} is {value!r}; ds_fssdp maps only {flag}={expected!r}")
    act = getattr(experts, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        raise ValueError(f"{where}: expert activation {type(act).__name__} (config.hidden_act "
                         f"{getattr(getattr(experts, 'config', None), 'hidden_act', '?')!r}) is not supported; "
                         "FSSDP's gated expert is silu (hidden_act 'silu' or 'swish')")
    gate_up, down = experts.gate_up_proj, experts.down_proj
    E, I2, H = gate_up.shape
    if I2 % 2 or tuple(down.shape) != (E, H, I2 // 2):
        raise ValueError(f"{where}: experts.gate_up_proj {tuple(gate_up.shape)} and experts.down_proj "
                         f"{tuple(down.shape)} are not [E, 2I, H] and [E, H, I]")


def to_fssdp_experts(gate_up_EIH: torch.Tensor, down_EHI: torch.Tensor) -> dict:
    """HF fused tensors -> FSSDPMoE swiglu tensors (contiguous copies)."""
    I = down_EHI.shape[-1]
    return {"w_gate": gate_up_EIH[:, :I, :].transpose(1, 2).contiguous(),
            "w_up": gate_up_EIH[:, I:, :].transpose(1, 2).contiguous(),
            "w_down": down_EHI.transpose(1, 2).contiguous()}


def to_hf_experts(tensors: dict) -> dict:
    """FSSDPMoE swiglu tensors -> HF ``{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}``."""
    gate_up = torch.cat([tensors["w_gate"], tensors["w_up"]], dim=2).transpose(1, 2).contiguous()
    return {"gate_up_proj": gate_up, "down_proj": tensors["w_down"].transpose(1, 2).contiguous()}


class FSSDPSparseMoeBlock(nn.Module):
    """One HF sparse MoE block on FSSDP: the HF router (``gate``), an :class:`FSSDPMoE` holding the
    experts (``moe``, found and sharded by ``ds_fssdp.initialize``) and, for Qwen2-MoE, the HF
    shared expert and its gate. ``forward`` returns what the HF block returns (the hidden states)."""

    def __init__(self, block: nn.Module, family: Family, *, where: str):
        super().__init__()
        experts = block.experts
        check_experts(experts, where)
        gate_up, down = experts.gate_up_proj, experts.down_proj
        E, I2, H = gate_up.shape
        router = block.gate
        k = int(router.top_k)
        self.family = family.model_type
        self.gate = router
        # Built on the meta device: the real tensors are the HF ones, mapped below (no random init,
        # no second full copy of the layer's experts).
        moe = FSSDPMoE(hidden_size=H, ffn_hidden_size=I2 // 2, num_experts=E, k=k, activation="swiglu",
                       device="meta", dtype=gate_up.dtype)
        moe.gate = RouterGate(router, E)
        with torch.no_grad():
            for name, tensor in to_fssdp_experts(gate_up.detach(), down.detach()).items():
                setattr(moe, name, nn.Parameter(tensor, requires_grad=gate_up.requires_grad))
        self.moe = moe
        self.shared_expert = block.shared_expert if family.shared_expert else None
        self.shared_expert_gate = block.shared_expert_gate if family.shared_expert else None
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0)) if family.jitter else 0.0
        # The HF block is kept outside the module tree for the way back (``to_hf_block``); its
        # router and shared expert are the modules registered above, its experts' storage is freed.
        self._experts_requires_grad = gate_up.requires_grad
        object.__setattr__(self, "_hf_block", block)
        experts.gate_up_proj = nn.Parameter(torch.empty(gate_up.shape, dtype=gate_up.dtype, device="meta"))
        experts.down_proj = nn.Parameter(torch.empty(down.shape, dtype=down.dtype, device="meta"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states
        if self.training and self.jitter_noise > 0:
            # Mixtral: the same draw and product as MixtralSparseMoeBlock (out of place here).
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x_TH = x.reshape(-1, x.shape[-1])
        out_TH, _, _ = self.moe(x_TH)
        if self.shared_expert is not None:
            shared_TH = F.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
            out_TH = out_TH + shared_TH
        return out_TH.reshape(hidden_states.shape)

    @torch.no_grad()
    def hf_expert_tensors(self) -> dict:
        """``{"gate_up_proj", "down_proj"}`` in HF layout, like the router weight (collective once the
        experts are sharded: every rank must call it, in the same layer order)."""
        like = self.gate.weight  # the dense parameters' device and dtype (bf16 once an engine casts them)
        return {k: v.to(device=like.device, dtype=like.dtype) for k, v in
                to_hf_experts(self.moe.export_experts()).items()}

    @torch.no_grad()
    def to_hf_block(self) -> nn.Module:
        """The original HF block holding the current weights (collective once sharded)."""
        block = self._hf_block
        for name, tensor in self.hf_expert_tensors().items():
            setattr(block.experts, name, nn.Parameter(tensor, requires_grad=self._experts_requires_grad))
        return block

    def extra_repr(self) -> str:
        return f"family={self.family}, jitter_noise={self.jitter_noise}"

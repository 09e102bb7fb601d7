"""What an HF experts module computes, checked before it is replaced: the gate-weighted sum of the
expert MLPs that ``hf_experts.to_fssdp`` maps, and nothing else (docs/design.md section 5).

Legend: E experts, H hidden, I expert FFN hidden, T tokens, K top-k.

A family may compute more inside the module (a subclass overriding the decorated forward, tensors
of its own such as Ergo's ``post_expert_norm``); replacing it would drop that silently, so it is
refused by name: any parameter or buffer beyond the mapped tensors, and any forward whose output on
probe values differs from the weighted expert MLPs of ``ds_fssdp.ops``. The probe runs the module's
own (eager) forward on a copy holding small random tensors of its layout (H = 8, I = 4), or, for a
forward sized by its config, at its own H and I with every expert a view of one. Checked once per
class, forward, layout and config.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ds_fssdp import ops
from ds_fssdp.integrations.hf_experts import UnsupportedExpertsError

# The tensors of transformers' experts contract that ``to_fssdp`` maps.
MAPPED = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
_H, _I, _T = 8, 4, 6


class ExtraComputeError(UnsupportedExpertsError):
    """An experts module computes more than the weighted expert MLPs FSSDP would replace it with."""


def check_forward(experts: nn.Module, layout, *, model_type, where: str) -> None:
    """Refuse ``experts`` (by name) unless its forward is the gate-weighted expert MLP of ``layout``."""
    extra = [n for n, _ in experts.named_parameters() if n not in MAPPED] + [n for n, _ in experts.named_buffers()]
    if extra:
        raise ExtraComputeError(
            f"{where}: model_type {model_type!r}: the experts module holds {extra} beside its expert tensors; its "
            f"forward uses them ({_forward_owner(experts)}), and ds_fssdp's expert compute would drop them")
    config = getattr(experts, "config", None)
    key = (type(experts), type(experts).forward, repr(layout),
           config.to_json_string() if hasattr(config, "to_json_string") else id(config))
    if key in _CHECKED:  # every layer of a model: one class, forward, layout and config
        return
    with torch.no_grad():
        try:
            got, want = _probe(experts, layout, hidden=_H, ffn=_I, distinct=True)
        except Exception:  # noqa: BLE001 - a forward sized by its config: again at the module's own sizes
            try:
                got, want = _probe(experts, layout, hidden=layout.hidden, ffn=layout.ffn, distinct=False)
            except Exception as err:  # noqa: BLE001 - any failure is named: the forward is not the contract's
                raise ExtraComputeError(
                    f"{where}: model_type {model_type!r}: the experts module's forward ({_forward_owner(experts)}) "
                    f"does not run on probe tensors of its own layout ({type(err).__name__}: {err}); ds_fssdp "
                    "cannot check what it computes") from err
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or \
            not torch.allclose(got.float(), want, rtol=1e-4, atol=1e-5):
        diff = float((got.float() - want).abs().max()) if isinstance(got, torch.Tensor) and \
            got.shape == want.shape else f"shape {getattr(got, 'shape', type(got))}"
        raise ExtraComputeError(
            f"{where}: model_type {model_type!r}: the experts module's forward ({_forward_owner(experts)}) computes "
            f"something other than the gate-weighted sum of its expert MLPs (max difference {diff} on probe values); "
            "ds_fssdp would drop the rest, so it does not convert this family")
    _CHECKED.add(key)


_CHECKED: set = set()


def _probe(experts: nn.Module, layout, *, hidden: int, ffn: int, distinct: bool) -> tuple:
    """(the module's forward, the weighted expert MLPs) on probe tokens, its tensors at ``hidden`` and
    ``ffn``; ``distinct=False``: every expert one random expert (a view: no E copies at full size)."""
    probe = _probe_copy(experts, layout, hidden=hidden, ffn=ffn, distinct=distinct)
    gen = torch.Generator().manual_seed(1)
    E, K = layout.num_experts, min(2, layout.num_experts)
    x_TH = torch.randn(_T, hidden, generator=gen)
    idx_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(_T)])
    w_TK = torch.rand(_T, K, generator=gen) + 0.25
    got = type(experts).forward(probe, x_TH, idx_TK, w_TK)
    return got, _weighted_mlps(probe, layout, x_TH, idx_TK, w_TK, hidden=hidden, ffn=ffn)


def _forward_owner(experts: nn.Module) -> str:
    return next((f"{cls.__name__}.forward" for cls in type(experts).__mro__ if "forward" in cls.__dict__), "forward")


def _probe_copy(experts: nn.Module, layout, *, hidden: int, ffn: int, distinct: bool) -> nn.Module:
    """A shallow copy of the module (same class, config and activation) holding random tensors."""
    probe = copy.copy(experts)
    probe._parameters = {}
    probe._buffers = dict(experts._buffers)
    probe._modules = dict(experts._modules)
    config = getattr(experts, "config", None)
    if config is not None and hasattr(config, "_experts_implementation_internal"):
        # The family's own (eager) math on CPU probe tensors, whatever kernel the model was loaded with.
        probe.config = copy.copy(config)
        probe.config._experts_implementation_internal = "eager"
    gen = torch.Generator().manual_seed(0)
    E, out = layout.num_experts, (2 * ffn if layout.gated else ffn)
    shapes = {layout.up_name: (hidden, out) if layout.transposed else (out, hidden),
              "down_proj": (ffn, hidden) if layout.transposed else (hidden, ffn)}
    if layout.bias:
        shapes.update({f"{layout.up_name}_bias": (out, ), "down_proj_bias": (hidden, )})
    for name, shape in shapes.items():
        t = torch.randn((E if distinct else 1, *shape), generator=gen) * (0.5 if distinct else shape[-1]**-0.5)
        probe._parameters[name] = nn.Parameter(t if distinct else t.expand(E, *shape), requires_grad=False)
    return probe


def _weighted_mlps(probe: nn.Module, layout, x_TH, idx_TK, w_TK, *, hidden: int, ffn: int) -> torch.Tensor:
    """sum_k w[t, k] * MLP_{idx[t, k]}(x[t]) through ``ds_fssdp.ops`` (what FSSDP computes)."""
    from dataclasses import replace

    from ds_fssdp.integrations.hf_experts import to_fssdp
    weights = to_fssdp(probe, replace(layout, hidden=hidden, ffn=ffn), copy=False)
    out = torch.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            y = ops.expert_mlp(x_TH[t:t + 1], {n: v[e:e + 1] for n, v in weights.items()}, [1],
                               activation=layout.activation, act_params=layout.act_params or None)
            out[t] += w_TK[t, k] * y[0]
    return out

"""The expert activations: which weights (and optional biases) each one uses, the parameters it
needs, and its elementwise formula.

Legend: R rows, F expert FFN hidden. Weight sides: "in" is [H, F] (hidden -> FFN), "out" is
[F, H]. A weight ``w_x`` has the optional bias ``b_x``: [F] on the "in" side, [H] on the "out"
side, added to that GEMM's output before the activation.

Non-gated (h = x @ w_a + b_a; y = act(h) @ w_b + b_b):
  gelu          gelu(h), exact erf form
  relu2         relu(h)^2                   (transformers' "relu2", NemotronH's has_gate=False experts)
Gated (g = x @ w_gate + b_gate, u = x @ w_up + b_up; y = act(g, u) @ w_down + b_down):
  swiglu        silu(g) * u
  geglu         gelu(g) * u, exact erf form
  geglu_tanh    gelu_tanh(g) * u            (transformers' "gelu_pytorch_tanh")
  swiglu_limit  silu(min(g, limit)) * clamp(u, -limit, limit)
  gptoss        g' = min(g, limit); (clamp(u, -limit, limit) + 1) * (g' * sigmoid(g' * alpha))

The gated formulas repeat transformers 5.24's operations in their order (so results match to the
bit): relu2 is ``activations.py: ReLUSquaredActivation``; swiglu / geglu / geglu_tanh are ``integrations/moe.py: _default_apply_gate`` with
``ACT2FN["silu" | "gelu" | "gelu_pytorch_tanh"]``; swiglu_limit is
``models/deepseek_v4/modeling_deepseek_v4.py: DeepseekV4Experts._apply_gate`` (the same clamps as
glm5_next, hy_v4, minimax_m3_vl); gptoss is ``models/gpt_oss/modeling_gpt_oss.py:
GptOssExperts._apply_gate``.
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F

PLAIN = (("w_a", "in"), ("w_b", "out"))
GATED = (("w_gate", "in"), ("w_up", "in"), ("w_down", "out"))


class Activation(NamedTuple):
    weights: tuple  # ((name, side), ...) in row order
    params: tuple  # names of the required float parameters
    fn: Callable  # gated: (g, u, params) -> act; non-gated: (h, params) -> act


def _gptoss(g, u, p):
    g, u = g.clamp(min=None, max=p["limit"]), u.clamp(min=-p["limit"], max=p["limit"])
    return (u + 1) * (g * torch.sigmoid(g * p["alpha"]))


TABLE = {
    "gelu": Activation(PLAIN, (), lambda h, p: F.gelu(h)),
    "relu2": Activation(PLAIN, (), lambda h, p: torch.square(F.relu(h))),
    "swiglu": Activation(GATED, (), lambda g, u, p: F.silu(g) * u),
    "geglu": Activation(GATED, (), lambda g, u, p: F.gelu(g) * u),
    "geglu_tanh": Activation(GATED, (), lambda g, u, p: F.gelu(g, approximate="tanh") * u),
    "swiglu_limit": Activation(GATED, ("limit", ),
                               lambda g, u, p: F.silu(g.clamp(max=p["limit"])) * u.clamp(min=-p["limit"], max=p["limit"])),
    "gptoss": Activation(GATED, ("alpha", "limit"), _gptoss),
}

# name -> ((weight name, side), ...): the weights each activation's experts hold, in row order.
ACTIVATIONS = {name: act.weights for name, act in TABLE.items()}


def is_gated(activation: str) -> bool:
    return TABLE[activation].weights is GATED


def bias_name(weight_name: str) -> str:
    """w_gate -> b_gate."""
    return "b" + weight_name[1:]


def biases(activation: str) -> tuple:
    """((bias name, side), ...) of the activation's weights, in row order."""
    return tuple((bias_name(n), side) for n, side in TABLE[activation].weights)


def check(activation: str, act_params: Optional[Mapping[str, float]]) -> dict:
    """The activation's parameters as a dict of floats; ValueError naming an unknown activation, a
    missing or unknown parameter, or a value that is not a finite number."""
    if activation not in TABLE:
        raise ValueError(f"activation ({activation!r}) must be one of {tuple(TABLE)}")
    given = dict(act_params or {})
    need = TABLE[activation].params
    missing = [k for k in need if k not in given]
    if missing:
        raise ValueError(f"activation {activation!r} needs act_params {list(need)}; missing {missing} "
                         f"(got {given})")
    unknown = [k for k in given if k not in need]
    if unknown:
        raise ValueError(f"act_params {unknown} are not used by activation {activation!r} (it takes {list(need)})")
    out = {}
    for k, v in given.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"act_params[{k!r}] ({v!r}) must be a finite number for activation {activation!r}")
        out[k] = float(v)
    return out


def apply(activation: str, params: Mapping[str, float], *inputs: torch.Tensor) -> torch.Tensor:
    """act(h) or act(g, u) (``params`` as returned by ``check``)."""
    return TABLE[activation].fn(*inputs, params)

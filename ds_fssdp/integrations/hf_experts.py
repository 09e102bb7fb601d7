"""FSSDP behind transformers' experts contract: one HF experts module <-> one FSSDPExperts.

Legend: E experts, H hidden, I expert FFN hidden (HF's ``moe_intermediate_size``), T tokens, K top-k.

transformers 5.x decorates a family's experts module with ``use_experts_implementation``: its
forward is ``(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` with the
routing weights applied inside, and layout flags say how its fused tensors are stored:

* ``has_gate``: ``gate_up_proj`` (gate and up fused) or only ``up_proj``;
* ``is_transposed``: weights applied as ``x @ W`` ([E, H, 2I], [E, I, H]) instead of ``x @ W^T``;
* ``is_concatenated``: gate rows then up rows, or interleaved (gate0, up0, gate1, ...);
* ``has_bias``: ``gate_up_proj_bias`` [E, 2I] / ``up_proj_bias`` [E, I] and ``down_proj_bias`` [E, H];
* ``has_post_expert_norm``: a norm after each expert (not mapped: refused).

Rather than a table of families, :func:`read_layout` runs the module's own ``_apply_gate`` (gated) or
``act_fn`` on probe values (clamps included) and picks the ``ds_fssdp.ops`` expert variant computing
the same function, its constants (``alpha``, ``limit``) read from the module; none: refused by name.
The mapping into FSSDP's named tensors ([E, H, I] / [E, I, H] and their biases, in the spec's row
order) is exact: transposes, slices and de-interleaving, inverted by :func:`to_hf`.
"""
from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ds_fssdp import ops
from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.moe.experts_module import FSSDPExperts
from ds_fssdp.moe.layer import expert_seed
from ds_fssdp.ops import activations
from ds_fssdp.ops.lora import LoraFactors

LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
# Where families keep the constants of their clamped activations (module attribute or config key).
_CONSTANT_NAMES = {"alpha": ("alpha", "swiglu_alpha"), "limit": ("limit", "swiglu_limit")}


class UnsupportedExpertsError(ValueError):
    """An experts module whose math ds_fssdp's expert variants do not reproduce."""


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` follows transformers' experts contract (``use_experts_implementation``)."""
    return all(hasattr(module, f) for f in LAYOUT_FLAGS) and hasattr(type(module), "_apply_gate")


def has_peft() -> bool:
    """Whether PEFT is loaded (a model cannot hold PEFT wrappers otherwise)."""
    return "peft" in sys.modules


def is_param_wrapper(module: nn.Module) -> bool:
    return has_peft() and isinstance(module, importlib.import_module("peft.tuners.lora.layer").ParamWrapper)


@dataclass(frozen=True)
class Layout:
    """How one HF experts module stores its experts, and the FSSDP variant computing them."""
    num_experts: int
    hidden: int
    ffn: int
    gated: bool
    transposed: bool
    concatenated: bool
    bias: bool
    activation: str
    act_params: dict = field(default_factory=dict)

    def spec(self) -> ExpertSpec:
        return ExpertSpec(self.activation, self.hidden, self.ffn, bias=self.bias, act_params=self.act_params or None)

    @property
    def up_name(self) -> str:
        """The HF tensor of the first projection: gate and up fused, or up alone."""
        return "gate_up_proj" if self.gated else "up_proj"


def read_layout(experts: nn.Module, *, model_type: str, where: str) -> Layout:
    """The module's layout and activation; refuses what the mapping cannot reproduce exactly."""
    if getattr(experts, "has_post_expert_norm", False):
        raise UnsupportedExpertsError(f"{where}: model_type {model_type!r}: experts with a post-expert norm "
                                      "(has_post_expert_norm) are not supported by ds_fssdp")
    if getattr(experts, "_is_expert_parallel", False):
        raise UnsupportedExpertsError(f"{where}: the experts module is already expert-parallel (transformers' own "
                                      "tensor/expert parallel plan); load the model without it")
    gated, transposed = bool(experts.has_gate), bool(experts.is_transposed)
    up, down = experts.gate_up_proj if gated else experts.up_proj, experts.down_proj
    if up.dim() != 3 or down.dim() != 3:
        raise UnsupportedExpertsError(f"{where}: model_type {model_type!r}: expert tensors of shapes "
                                      f"{tuple(up.shape)} and {tuple(down.shape)} are not fused [E, ...] tensors")
    E = up.shape[0]
    out_dim, H = (up.shape[2], up.shape[1]) if transposed else (up.shape[1], up.shape[2])
    I = out_dim // 2 if gated else out_dim
    want_down = (E, I, H) if transposed else (E, H, I)
    if (gated and out_dim % 2) or tuple(down.shape) != want_down:
        raise UnsupportedExpertsError(f"{where}: model_type {model_type!r}: {'gate_up_proj' if gated else 'up_proj'} "
                                      f"{tuple(up.shape)} and down_proj {tuple(down.shape)} do not fit the flags "
                                      f"is_transposed={transposed}, has_gate={gated}")
    activation, params = _probe_activation(experts, gated=gated, concatenated=bool(experts.is_concatenated),
                                           model_type=model_type, where=where)
    return Layout(num_experts=E, hidden=H, ffn=I, gated=gated, transposed=transposed,
                  concatenated=bool(experts.is_concatenated), bias=bool(experts.has_bias), activation=activation,
                  act_params=params)


def _constant(experts: nn.Module, name: str):
    owners = (experts, getattr(experts, "config", None))
    values = (getattr(owner, attr, None) for attr in _CONSTANT_NAMES[name] for owner in owners)
    return next((float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)), None)


@torch.no_grad()
def _probe_activation(experts, *, gated: bool, concatenated: bool, model_type: str, where: str):
    """Run the module's own activation on probe values and find the variant that matches it."""
    gen = torch.Generator().manual_seed(0)
    width = 16
    # Wide enough to cross every clamp the families use (GPT-OSS: limit 7), and small values.
    g = torch.cat([torch.linspace(-20, 20, 64), torch.randn(64, generator=gen)]).view(-1, 1).expand(-1, width)
    u = torch.cat([torch.randn(64, generator=gen) * 10, torch.linspace(-3, 3, 64)]).view(-1, 1).expand(-1, width)
    g, u = g.contiguous().float(), u.flip(0).contiguous().float()
    if gated:
        want = experts._apply_gate(_join(g, u, concatenated)).float()
        hook = "_apply_gate"
    else:
        want = experts.act_fn(g).float()
        hook = f"act_fn ({type(getattr(experts, 'act_fn', None)).__name__})"
    tried = []  # ops' variants of this kind, in ops' order, with the constants each needs
    for name in (n for n in ops.ACTIVATIONS if activations.is_gated(n) == gated):
        params = {n: _constant(experts, n) for n in activations.TABLE[name].params}
        if any(v is None for v in params.values()):
            continue
        tried.append(name)
        got = _variant(name, params, g, u if gated else None)
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            return name, params
    raise UnsupportedExpertsError(
        f"{where}: model_type {model_type!r}: the experts' activation ({type(experts).__name__}.{hook}) matches none "
        f"of ds_fssdp's expert variants (tried {', '.join(tried)}); ds_fssdp.ops has no expert variant for it")


def _variant(name: str, params: dict, g_RI: torch.Tensor, u_RI: torch.Tensor | None) -> torch.Tensor:
    """One variant's activation through ``ops.expert_mlp`` itself, with identity weights."""
    R, I = g_RI.shape
    eye = torch.eye(I)
    zero = torch.zeros(I, I)
    if u_RI is None:
        weights = {"w_a": eye[None], "w_b": eye[None]}
        x = g_RI
    else:
        weights = {"w_gate": torch.cat([eye, zero])[None], "w_up": torch.cat([zero, eye])[None], "w_down": eye[None]}
        x = torch.cat([g_RI, u_RI], -1)
    return ops.expert_mlp(x, weights, [R], activation=name, act_params=params or None)


def to_fssdp(experts: nn.Module, layout: Layout, *, copy: bool = True) -> dict:
    """HF fused tensors -> FSSDP's named [E, ...] tensors (contiguous copies; ``copy=False``: views
    of the HF tensors, for a caller that copies them into place itself)."""
    up, down = getattr(experts, layout.up_name).detach(), experts.down_proj.detach()
    # applied as x @ W: [E, H, 2I] (or [E, H, I]) and [E, I, H]
    tensors = _unfuse(up if layout.transposed else up.transpose(1, 2),
                      down if layout.transposed else down.transpose(1, 2), layout)
    if layout.bias:
        tensors += _unfuse(getattr(experts, f"{layout.up_name}_bias").detach(), experts.down_proj_bias.detach(), layout)
    out = dict(zip(layout.spec().names, tensors))
    return {k: v.contiguous().clone() for k, v in out.items()} if copy else out


def to_hf(tensors: dict, layout: Layout) -> dict:
    """FSSDP's named tensors -> the HF module's fused tensors by attribute name (the inverse)."""
    values, weights = [tensors[n] for n in layout.spec().names], 3 if layout.gated else 2
    up, down = _fuse(values[:weights], layout)
    out = {layout.up_name: up if layout.transposed else up.transpose(1, 2),
           "down_proj": down if layout.transposed else down.transpose(1, 2)}
    if layout.bias:
        out[f"{layout.up_name}_bias"], out["down_proj_bias"] = _fuse(values[weights:], layout)
    return {k: v.contiguous() for k, v in out.items()}


def _unfuse(up, down, layout) -> list:
    """An up tensor (gate and up fused when gated) and a down tensor -> FSSDP's tensors in row order."""
    return [*_up_parts(up, layout), down]


def _up_parts(up, layout) -> tuple:
    """The FSSDP tensors an up tensor holds: (gate, up) when gated, else (up, )."""
    return _split(up, layout.ffn, layout.concatenated) if layout.gated else (up, )


def _fuse(parts: list, layout) -> tuple:
    """The inverse of :func:`_unfuse`: (up, down)."""
    return (_join(parts[0], parts[1], layout.concatenated) if layout.gated else parts[0]), parts[-1]


def _split(t, I, concatenated):
    return (t[..., :I], t[..., I:]) if concatenated else (t[..., 0::2], t[..., 1::2])


def _join(gate, up, concatenated):
    return torch.cat([gate, up], -1) if concatenated else torch.stack([gate, up], -1).flatten(-2)


# -- LoRA factors in the expert compute (PEFT's wrappers: integrations/peft_lora.py) ------------------
class ExpertLora:
    """The active adapters' factors of one experts module, by FSSDP weight name, stacked [E, ...]."""

    def __init__(self, experts: "FSSDPHFExperts", active: dict):
        E, self.stacks = experts.num_experts, {}
        for hf_name, adapters in active.items():
            for A_w, B_w, scaling in adapters:
                r = A_w.shape[0] // E
                a_EIr = A_w.view(E, r, A_w.shape[1]).transpose(1, 2)
                b_ErO = B_w.view(B_w.shape[0], r, E).permute(2, 1, 0)
                for name, part_ErO in _fssdp_parts(hf_name, b_ErO, experts.layout):
                    self.stacks.setdefault(name, []).append((a_EIr, part_ErO, float(scaling)))

    def __call__(self, local_E: torch.Tensor) -> dict:
        """The factors of the experts computed here, in compute-slot order."""
        out = {}
        for name, stacks in self.stacks.items():
            idx = local_E.to(stacks[0][0].device)
            out[name] = [LoraFactors(a.index_select(0, idx), b.index_select(0, idx), s) for a, b, s in stacks]
        return out


def _fssdp_parts(hf_name: str, b_ErO: torch.Tensor, layout) -> list:
    """The FSSDP weights an HF target feeds, with their columns of ``B^T``."""
    names = layout.spec().names[:3 if layout.gated else 2]
    return [(names[-1], b_ErO)] if hf_name == "down_proj" else list(zip(names, _up_parts(b_ErO, layout)))


def _drop_stand_ins(module, state_dict, prefix, local_metadata) -> None:
    for name in module.stand_ins:
        state_dict.pop(prefix + name, None)


def _keep_stand_ins(module, state_dict, prefix, *args) -> None:
    for name in module.stand_ins:
        state_dict.setdefault(prefix + name, module._parameters[name])


class FSSDPHFExperts(FSSDPExperts):
    """Stands in for one HF experts module: same forward contract, experts trained by FSSDP. The
    family's block (router, shared experts, scaling) is untouched around it."""

    def __init__(self, experts: nn.Module, *, model_type: str, where: str, top_k: int | None = None):
        layout = read_layout(experts, model_type=model_type, where=where)
        from ds_fssdp.integrations.hf_forward import check_forward
        check_forward(experts, layout, model_type=model_type, where=where)  # nothing computed beyond the mapped MLPs
        hf_params = dict(experts.named_parameters(recurse=False))
        first = next(iter(hf_params.values()))
        # Built on the meta device: the real tensors are the HF ones, mapped below.
        super().__init__(spec=layout.spec(), hidden_size=layout.hidden, ffn_hidden_size=layout.ffn,
                         num_experts=layout.num_experts, device="meta", dtype=first.dtype)
        flags = {p.requires_grad for p in hf_params.values()}
        if len(flags) > 1:
            raise ValueError(f"{where}: some expert tensors require grad and others do not "
                             f"({ {n: p.requires_grad for n, p in hf_params.items()} }); ds_fssdp trains or freezes "
                             "an expert's tensors together")
        requires_grad = flags.pop()
        with torch.no_grad():
            for name, tensor in to_fssdp(experts, layout).items():
                setattr(self, name, nn.Parameter(tensor, requires_grad=requires_grad))
        self.layout = layout
        self.model_type = model_type
        self.k = top_k
        # PEFT LoRA (peft_lora.py; docs/design.md, "LoRA on experts"): PEFT reads the layout flag, the
        # wrappers set their factors here for one forward, and the HF tensor names stay as empty
        # stand-ins with ``ds_shape``, out of every state dict (dropped by ``prepare_initialize``
        # when no wrapper targets this module).
        self.is_transposed = layout.transposed
        self._lora_active = {}
        self._adopt_handle = None  # convert's forward pre-hook on the MoE block (peft_lora.adopt_hook)
        self.stand_ins = tuple(hf_params)
        self.register_state_dict_post_hook(_drop_stand_ins)
        self.register_load_state_dict_pre_hook(_keep_stand_ins)
        # The HF module, outside the module tree, for the way back (``to_hf_module``), its storage freed
        # (meta tensors); ``_fresh_init``: (seed, the model's _init_weights) of a lazy module
        # (hf_load.from_config), how fresh_rows draws each expert.
        object.__setattr__(self, "_hf_experts", experts)
        object.__setattr__(self, "_fresh_init", None)
        for name, p in hf_params.items():
            stand_in = nn.Parameter(torch.empty(0, dtype=p.dtype, device="cpu" if p.is_meta else p.device),
                                    requires_grad=False)
            stand_in.ds_shape = p.shape
            setattr(self, name, stand_in)
            setattr(experts, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                requires_grad=p.requires_grad))

    @torch.no_grad()
    def fresh_rows(self, owned_E: torch.Tensor) -> torch.Tensor:
        """Rows [S, P] of the experts ``owned_E`` of a lazy module: each expert initialized by the
        family's own ``_init_weights`` on a one-expert copy of the HF module, under torch's global
        generator seeded by the layer's seed and the expert (the same values at any world size)."""
        if self._fresh_init is None:
            return super().fresh_rows(owned_E)
        seed, init_weights = self._fresh_init
        experts = self._hf_experts
        meta = dict(experts.named_parameters(recurse=False))
        dtype = self._parameters[self.spec.names[0]].dtype
        rows_SP = torch.empty(owned_E.numel(), self.spec.numel, dtype=dtype)
        try:
            for s, e in enumerate(owned_E.tolist()):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(expert_seed(seed, e))
                    for name, p in meta.items():
                        setattr(experts, name, nn.Parameter(torch.empty((1, *p.shape[1:]), dtype=p.dtype),
                                                            requires_grad=False))
                    init_weights(experts)
                rows_SP[s] = self.spec.flatten(to_fssdp(experts, self.layout))[0]
        finally:
            for name, p in meta.items():
                setattr(experts, name, p)
        return rows_SP

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return super().forward(hidden_states, top_k_index, top_k_weights).to(hidden_states.dtype)

    def lora_factors(self):
        """The LoRA factors the PEFT wrappers above made active for this forward (None: none)."""
        active = {name: factors for name, factors in self._lora_active.items() if factors}
        return ExpertLora(self, active) if active else None

    def prepare_initialize(self, ds_config: dict, fcfg, *, model: nn.Module) -> None:
        """Called by ``ds_fssdp.initialize`` before any collective: where a PEFT wrapper targets
        these experts, refuses by key what LoRA on them cannot run; without LoRA the PEFT stand-ins
        go (ZeRO 3 would partition them)."""
        if not any(is_param_wrapper(m) and m.get_base_layer() is self for m in model.modules()):
            for name in self.stand_ins:
                self._parameters.pop(name, None)
            self.stand_ins = ()
            return
        where = f"LoRA on FSSDP experts ({self.extra_repr()})"
        if (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3:
            raise ValueError(f"{where}: zero_optimization.stage (3) is not supported: ZeRO-3 would partition the LoRA "
                             "factors, which the expert compute reads whole; use stage 0, 1 or 2 (the base experts "
                             "are sharded by FSSDP either way)")
        if fcfg.rematerialize:
            raise ValueError(f"{where}: fssdp.rematerialize (true) is not supported: the re-materializing backward "
                             "recomputes the expert MLP outside autograd, so the LoRA factors would get no gradient")

    @contextmanager
    def lora(self, param_name: str, factors: list):
        """Context: ``factors`` [(lora_A.weight, lora_B.weight, scaling)] are the active LoRA of the
        HF tensor ``param_name`` for one forward (PEFT's wrappers, ``peft_lora.py``)."""
        self._lora_active[param_name] = factors
        try:
            yield
        finally:
            self._lora_active.pop(param_name, None)

    @property
    def lora_targets(self) -> dict:
        """HF tensor name -> (in, out) features of the projections LoRA may target."""
        lay = self.layout
        return {lay.up_name: (lay.hidden, 2 * lay.ffn if lay.gated else lay.ffn), "down_proj": (lay.ffn, lay.hidden)}

    @torch.no_grad()
    def hf_tensors(self, like: torch.Tensor | None = None) -> dict:
        """The HF module's tensors by attribute name (collective once sharded: every rank calls it,
        in the same module order). ``like``: the device and dtype to return them in."""
        tensors = to_hf(self.export_experts(), self.layout)
        return tensors if like is None else {k: v.to(device=like.device, dtype=like.dtype) for k, v in tensors.items()}

    @torch.no_grad()
    def to_hf_module(self, like: torch.Tensor | None = None) -> nn.Module:
        """The original HF experts module holding the current weights (collective once sharded)."""
        experts = self._hf_experts
        for name, tensor in self.hf_tensors(like).items():
            setattr(experts, name, nn.Parameter(tensor, requires_grad=getattr(experts, name).requires_grad))
        return experts

    def extra_repr(self) -> str:
        lay = self.layout
        return (f"model_type={self.model_type}, experts={lay.num_experts}, hidden={lay.hidden}, ffn={lay.ffn}, "
                f"activation={lay.activation}{lay.act_params or ''}, bias={lay.bias}")

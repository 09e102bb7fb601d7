"""PEFT LoRA on FSSDP experts (``LoraConfig(target_parameters=[...])``): the wrappers' side.

Legend: E experts, I in features, O out features, r LoRA rank.

PEFT's ``ParamWrapper`` of a fused [E, ...] expert tensor holds ``lora_A`` = ``Linear(I, r * E)`` and
``lora_B`` = ``Linear(r * E, O)`` and would parametrize the whole tensor, which FSSDP shards. The
wrappers are adopted instead: their class becomes :class:`FSSDPParamWrapper` (a ``ParamWrapper``
subclass: PEFT's saving, loading, adapter switching and ``isinstance`` checks keep working), whose
forward hands its factors to the ``FSSDPHFExperts`` below it for one forward (``hf_experts.ExpertLora``,
``ops/lora.py``). Adopted at ``convert``, or at the MoE block's next forward when PEFT comes after it;
``unconvert`` gives them their class back (``merge_and_unload`` works then). The whole path and what
is refused: docs/design.md section 4, "LoRA on experts"; README, "LoRA on experts, TRL and accelerate".
"""
from __future__ import annotations

import functools
import re

import torch.nn as nn

# The experts' side of LoRA (their factors in the compute, targets, checks) and PEFT detection live with
# the experts module (has_peft: also for this module's callers)
from ds_fssdp.integrations.hf_experts import FSSDPHFExperts, has_peft, is_param_wrapper

def strip_wrappers(name: str) -> str:
    """The module name PEFT's wrappers took over: ``a.experts.base_layer.base_layer`` -> ``a.experts``."""
    return re.sub(r"(\.base_layer)+$", "", name)


def wrapper_chain(site: nn.Module) -> list:
    """The ParamWrappers from ``site`` (outermost) down to the module they wrap."""
    chain = []
    while is_param_wrapper(site):
        chain.append(site)
        site = site.base_layer
    return chain


# -- adoption ----------------------------------------------------------------------------------
@functools.cache
def fssdp_wrapper_class():
    """:class:`FSSDPParamWrapper`, defined on first use (PEFT is an optional dependency)."""
    from peft.tuners.lora.layer import ParamWrapper

    class FSSDPParamWrapper(ParamWrapper):
        """A ``ParamWrapper`` whose base experts are FSSDP's: the LoRA factors go into the
        expert compute instead of a parametrization of the (sharded) expert tensor."""

        def forward(self, x, *args, **kwargs):
            experts = self.get_base_layer()
            if not isinstance(experts, FSSDPHFExperts):  # unconverted again
                return super().forward(x, *args, **kwargs)
            self._check_forward_args(x, *args, **kwargs)
            kwargs.pop("adapter_names", None)
            adapters = [] if self.disable_adapters else [a for a in self.active_adapters if a in self.lora_A]
            factors = [(self.lora_A[a].weight, self.lora_B[a].weight, self.scaling[a]) for a in adapters]
            with experts.lora(self.parameter_name, factors):
                return self.base_layer(x, *args, **kwargs)

        def merge(self, *args, **kwargs):
            if isinstance(self.get_base_layer(), FSSDPHFExperts):
                raise ValueError(f"PEFT merge on FSSDP experts ({self.parameter_name}): the base experts are "
                                 "sharded; call ds_fssdp.integrations.hf.unconvert(model) first, then "
                                 "merge_and_unload()")
            return super().merge(*args, **kwargs)

    return FSSDPParamWrapper


def adopt(site: nn.Module, experts: FSSDPHFExperts, *, where: str) -> None:
    """Check the ParamWrappers from ``site`` down to ``experts`` and give them FSSDP's forward."""
    chain = wrapper_chain(site)
    if not chain:
        return
    cls = fssdp_wrapper_class()
    targets = experts.lora_targets
    for wrapper in chain:
        name = wrapper.parameter_name
        if name not in targets:
            raise ValueError(f"{where}: LoraConfig.target_parameters names {name!r}; on FSSDP experts "
                             f"(model_type {experts.model_type!r}) LoRA targets only {sorted(targets)}")
        for adapter, lora_A in wrapper.lora_A.items():
            rows, in_features = lora_A.weight.shape
            if rows % experts.num_experts or in_features != targets[name][0]:
                raise ValueError(f"{where}: the {adapter!r} adapter's {name} lora_A has shape "
                                 f"{(rows, in_features)}, not (r * {experts.num_experts}, {targets[name][0]})")
        if type(wrapper) is not cls:
            wrapper.__class__ = cls


def release(site: nn.Module) -> None:
    """Give the adopted wrappers their PEFT class back (after ``unconvert``)."""
    from peft.tuners.lora.layer import ParamWrapper
    for wrapper in wrapper_chain(site):
        if type(wrapper) is fssdp_wrapper_class():
            wrapper.__class__ = ParamWrapper


def adopt_hook(child: str, where: str):
    """A forward pre-hook for the MoE block holding the experts as ``child``: adopts wrappers PEFT
    put there after ``convert`` (one type check per forward once adopted)."""

    def hook(block, args):
        site = block._modules.get(child)
        if isinstance(site, FSSDPHFExperts) or not has_peft() or type(site) is fssdp_wrapper_class():
            return  # the experts themselves (no wrapper), no PEFT, or adopted already
        chain = wrapper_chain(site)
        if chain:
            adopt(site, chain[-1].base_layer, where=where)

    return hook


__all__ = ["adopt", "adopt_hook", "fssdp_wrapper_class", "has_peft", "is_param_wrapper", "release", "strip_wrappers",
           "wrapper_chain"]

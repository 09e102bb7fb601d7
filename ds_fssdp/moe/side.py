"""Work beside the exchange: a MoE block's shared experts computed inside its chunked token
exchange (``moe/pipeline.py``), while the last combine chunk is in flight, and handed to the
block's own call (the schedule's model: ``planner/schedule.py``, ``LayerLoad.side_rows``; as run
here, and where it is not: docs/design.md section 4, "Work beside the exchange").

Legend: T tokens, H hidden.

:class:`SharedSide` binds the shared module of a block that runs it after its routed experts on
the same hidden states; the experts module asks it for the layer's :class:`SideWork`, and the
block's call of the module gets the delivered output when its input is the tensor the work was
computed on (same storage, layout and version), else the module runs as written (and no more side
work is made: the same on every rank). The same module, input and weights compute the same values;
only where they run changes.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Callable

import torch
import torch.nn as nn
from deepspeed.utils import logger

SHARED_NAMES = ("shared_experts", "shared_expert")


@dataclasses.dataclass
class SideWork:
    """One layer's work beside the exchange: ``fn(x_TH)`` (rows of ``x_TH`` in, rows out), ``ratio``
    expert rows of compute per token (what the schedule prices it as)."""
    fn: Callable
    x_TH: torch.Tensor
    ratio: float
    deliver: Callable  # called with the output (detached from the layer's Function, with its autograd)


def side_ratio(module: nn.Module, *, hidden: int, ffn: int, matrices: int) -> float:
    """``module``'s forward FLOPs per token over one expert row's (``matrices`` matrices of
    ``hidden`` x ``ffn``): the weights of its linear layers over the expert's."""
    weights = sum(m.weight.numel() if getattr(m, "weight", None) is not None else 0
                  for m in module.modules() if isinstance(m, nn.Linear))
    weights = weights or sum(int(getattr(m, "ds_numel", 0)) for m in module.modules() if isinstance(m, nn.Linear))
    return float(weights) / float(matrices * hidden * ffn)


def runs_after_experts(block: nn.Module, experts: str, shared: str) -> bool:
    """Whether ``block``'s forward calls ``self.<shared>(`` only after ``self.<experts>(`` (read
    from its source; False when it cannot be read)."""
    try:
        src = inspect.getsource(type(block).forward)
    except (OSError, TypeError):
        return False
    first = src.find(f"self.{experts}(")
    calls = [m.start() for m in re.finditer(rf"self\.{re.escape(shared)}\(", src)]
    return first >= 0 and bool(calls) and min(calls) > first


def bind_shared(block: nn.Module, experts_name: str, *, hidden: int, ffn: int, matrices: int) -> SharedSide | None:
    """A :class:`SharedSide` over ``block``'s shared module (``SHARED_NAMES``) when the block runs
    it after its experts module ``experts_name``; None otherwise (the block runs it as written)."""
    for name in SHARED_NAMES:
        module = getattr(block, name, None)
        if isinstance(module, nn.Module) and runs_after_experts(block, experts_name, name):
            return SharedSide(module, side_ratio(module, hidden=hidden, ffn=ffn, matrices=matrices), site=(block, name))
    return None


class SharedSide:
    """A block's shared module, computed by its experts module beside the exchange (module
    docstring). Installs an instance ``forward`` on the module that returns the delivered output
    for the input it was computed on; nothing is registered, so state dicts do not change."""

    def __init__(self, module: nn.Module, ratio: float, *, site: tuple | None = None):
        """``site``: (block, attribute) the block calls the module through; when that attribute
        no longer holds the module (a wrapper put in its place, e.g. PEFT's ``modules_to_save``,
        whose copy the block then calls), no side work is made."""
        self.module, self.ratio, self.site = module, float(ratio), site
        self._forward = module.forward  # the class's, bound
        self._stash = None
        self.missed = False  # the block called the module on another input than the work's
        module.forward = self._call

    def release(self) -> None:
        """Put the module's own forward back."""
        self.module.__dict__.pop("forward", None)
        self._stash = None

    def in_place(self) -> bool:
        """Whether the block still calls this module (its ``site`` holds it)."""
        return self.site is None or getattr(self.site[0], self.site[1], None) is self.module

    def work(self, x_TH: torch.Tensor) -> SideWork | None:
        """The layer's side work over the experts' input ``x_TH`` (None where the block must
        compute it itself: also when the module has trainable weights but ``x_TH`` carries no
        gradient, since the layer's Function would have no input to take a backward through)."""
        self._stash = None
        trains_without_input_grad = (torch.is_grad_enabled() and not x_TH.requires_grad
                                     and any(p.requires_grad for p in self.module.parameters()))
        if self.missed or trains_without_input_grad or not self.in_place():
            return None
        key = _key(x_TH)
        return SideWork(fn=self._forward, x_TH=x_TH, ratio=self.ratio,
                        deliver=lambda y: setattr(self, "_stash", (key, y)))

    def _call(self, x, *args, **kwargs):
        stash, self._stash = self._stash, None
        if stash is not None:
            if not args and not kwargs and _key(x) == stash[0]:
                y = stash[1]
                return y.view(*x.shape[:-1], y.shape[-1])
            self.missed = True
            logger.warning(f"fssdp: {type(self.module).__name__} was called on another input than its block's "
                           "experts; it is no longer computed beside the exchange")
        return self._forward(x, *args, **kwargs)


def _key(x: torch.Tensor) -> tuple:
    return (x.data_ptr(), x.numel(), x.shape[-1], x.is_contiguous(), x._version, x.dtype, x.device)

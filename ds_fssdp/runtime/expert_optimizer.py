"""The expert optimizer: the dense optimizer's type and hyperparameters over the expert masters."""
from __future__ import annotations

import inspect

import torch

from ds_fssdp.config import FSSDPConfigError


def build_expert_optimizer(basic_optimizer, params: list):
    """The dense optimizer's type and constructor hyperparameters, over the expert masters (None
    when DeepSpeed has no optimizer: an inference engine)."""
    if basic_optimizer is None or not params:
        return None
    cls = type(basic_optimizer)
    allowed = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
    extra = {}
    try:
        from deepspeed.ops.adam import FusedAdam
        allowed += (FusedAdam, )
        if isinstance(basic_optimizer, FusedAdam):
            extra["adam_w_mode"] = basic_optimizer.adam_w_mode
    except ImportError:
        pass
    if cls not in allowed:
        raise FSSDPConfigError(f"optimizer {cls.__name__} is not supported for fssdp experts; use Adam, AdamW "
                               "or SGD (DeepSpeed config optimizer.type, with torch_adam true on CPU)")
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in basic_optimizer.defaults.items() if k in accepted}
    kwargs.update(extra)
    return cls(params, **kwargs)

"""The expert optimizer: the dense optimizer's type and hyperparameters over the expert masters."""
from __future__ import annotations

import inspect

import torch

from ds_fssdp.config import FSSDPConfigError

try:
    from deepspeed.ops.adam import FusedAdam
except ImportError:  # a DeepSpeed without its ops package: torch's optimizers only
    FusedAdam = None

# DeepSpeed's optimizer.type names (lower case, as DeepSpeed compares them) whose optimizer the experts run.
CONFIG_TYPES = ("adam", "adamw", "sgd")
ALLOWED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD) + ((FusedAdam, ) if FusedAdam is not None else ())


def _refuse(name: str) -> FSSDPConfigError:
    return FSSDPConfigError(f"optimizer {name} is not supported for fssdp experts; use Adam, AdamW or SGD "
                            "(DeepSpeed config optimizer.type, with torch_adam true on CPU)")


def check_expert_optimizer(ds_config: dict, optimizer=None, *, trains: bool = True) -> None:
    """Refuse an optimizer the experts cannot run, from the config's ``optimizer.type`` or the client
    optimizer's class, before any collective, on every rank alike (a pipeline stage without MoE
    layers too; ``trains``: some MoE layer of the model, on any stage, trains). A client optimizer
    factory is checked at attach (:func:`build_expert_optimizer`)."""
    if not trains:
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        if type(optimizer) not in ALLOWED:
            raise _refuse(type(optimizer).__name__)
        return
    kind = (ds_config.get("optimizer") or {}).get("type") if optimizer is None else None
    if kind is not None and str(kind).lower() not in CONFIG_TYPES:
        raise _refuse(f"{kind!r} (optimizer.type)")


def build_expert_optimizer(basic_optimizer, params: list):
    """The dense optimizer's type and constructor hyperparameters, over the expert masters (None
    when DeepSpeed has no optimizer: an inference engine)."""
    if basic_optimizer is None or not params:
        return None
    cls = type(basic_optimizer)
    if cls not in ALLOWED:
        raise _refuse(cls.__name__)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in basic_optimizer.defaults.items() if k in accepted}
    if FusedAdam is not None and isinstance(basic_optimizer, FusedAdam):
        kwargs["adam_w_mode"] = basic_optimizer.adam_w_mode
    return cls(params, **kwargs)

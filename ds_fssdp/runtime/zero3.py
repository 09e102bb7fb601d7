"""ZeRO stage 3 for the dense parameters while the experts stay under FSSDP (docs/design.md
section 5, step 1): the expert parameters leave the module before ``deepspeed.initialize``, so
ZeRO-3 partitions only the dense rest. Each ``FSSDPMoE`` is a ZeRO-3 leaf module (its gate returns a
dataclass, whose tensors ZeRO-3's per-module backward hooks do not walk: the leaf's hooks re-gather
the gate's weight for its backward), and experts partitioned by ``deepspeed.zero.Init`` are refused
by name (the HF loaders, ``integrations/hf_zero3.py``, partition only the dense part). Clipping over
dense and expert gradients: ``grad_norm.py``.
"""
from __future__ import annotations

from deepspeed.utils import set_z3_leaf_module

from ds_fssdp.config import FSSDPConfigError


def zero_stage(ds_config: dict) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def prepare_layers(layers: list, ds_config: dict) -> None:
    """Before ``deepspeed.initialize``: with ZeRO stage 3, refuse partitioned experts and mark
    every FSSDP layer a ZeRO-3 leaf. Nothing to do for stages 0-2."""
    if zero_stage(ds_config) != 3:
        return
    for i, layer in enumerate(layers):
        partitioned = [n for n in layer.spec.names if hasattr(layer._parameters.get(n), "ds_id")]
        if partitioned:
            raise FSSDPConfigError(
                f"zero_optimization.stage (3): FSSDP layer {i} has expert parameters {partitioned} partitioned by "
                "deepspeed.zero.Init; build the model outside zero.Init (ZeRO-3 partitions the dense parameters at "
                "initialize, FSSDP shards the experts by owner)")
        set_z3_leaf_module(layer, True)

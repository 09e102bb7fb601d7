"""ZeRO stage 3 for the dense parameters while the experts stay under FSSDP.

The expert parameters leave the module before ``deepspeed.initialize`` (engine.py), so ZeRO-3
partitions only the dense rest. Two things it needs to know about FSSDP layers:

* each ``FSSDPMoE`` is a ZeRO-3 leaf module (``deepspeed.utils.set_z3_leaf_module``): its
  gate's weight is gathered with the layer and kept until the layer's backward. The gate returns a
  ``GateOutput`` dataclass, whose tensors ZeRO-3's per-module backward hooks do not see (they
  walk tuples, lists and dicts only); the layer's own outputs are a tuple of tensors, so the hooks
  on the leaf re-gather the gate's weight for its backward;
* the expert parameters must still be whole tensors: a model built under ``deepspeed.zero.Init``
  has its experts partitioned already, which FSSDP cannot shard by owner (refused by name). The
  HF loaders (``integrations/hf_zero3.py``) partition only the dense part while they load, so
  their dense parameters arrive as ZeRO-3 parameters and their experts as each rank's own rows.

Clipping over dense and expert gradients hooks ZeRO-3's per-group norms (grad_norm.py).
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

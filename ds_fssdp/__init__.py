"""ds-fssdp: Fully Sharded Sparse Data Parallelism for MoE training, as a DeepSpeed extension.

    from ds_fssdp import FSSDPMoE, initialize
    engine, optimizer, _, _ = ds_fssdp.initialize(model=model, config="ds_config.json")

The names below are imported on first use (PEP 562), so ``import ds_fssdp`` alone does not
import DeepSpeed: ``python -m ds_fssdp.sim --json`` must choose where DeepSpeed's logger writes
before DeepSpeed is imported (it prints its accelerator warning to stdout on import).
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "FSSDPConfig": "ds_fssdp.config",
    "FSSDPConfigError": "ds_fssdp.config",
    "MoE": "ds_fssdp.integrations.deepspeed_moe",  # drop-in for deepspeed.moe.layer.MoE
    "FSSDPExperts": "ds_fssdp.moe.experts_module",
    "FSSDPMoE": "ds_fssdp.moe.layer",
    "initialize": "ds_fssdp.runtime.engine",
    "init_distributed": "ds_fssdp.runtime.elastic",  # restart-safe under torchrun --max-restarts
    "destroy_process_group": "ds_fssdp.runtime.elastic",
    "Preemption": "ds_fssdp.runtime.preempt",
    "resume": "ds_fssdp.runtime.resume",
    "save_step": "ds_fssdp.runtime.resume",
    "Topology": "ds_fssdp.topology",
}
__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ds_fssdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

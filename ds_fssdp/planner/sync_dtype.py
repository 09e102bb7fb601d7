"""The dtype the experts' expert-data-parallel (EDP) gradient sync communicates in: DeepSpeed's
rule, written once.

DeepSpeed (0.19.8, ``runtime/engine.py``: ``communication_data_type``) sends its gradients, its own
MoE experts' included, in the config's ``"communication_data_type"`` when set, else fp16 under
fp16 training, bf16 under bf16, else fp32; under Ulysses sequence parallelism its engine takes
``"seq_parallel_communication_data_type"`` instead (default fp32). The runtime's experts follow it
(``runtime/expert_dp.py``, the dtype the stage gets from here and checks against the engine's),
and so do the decisions and charges built on their bytes: the runtime's slices and split
decision (``runtime/edp_sync.py``) and the simulators' sync (``sim/setup.Setup.grad_sync_bytes``,
``sim/sync.py``). Pure: no torch, no DeepSpeed.
"""
from __future__ import annotations

COMM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element of each communication dtype
KEY = "communication_data_type"
SP_KEY = "seq_parallel_communication_data_type"


def configured_dtype(ds_config: dict | None, key: str = KEY, default: str | None = None) -> str | None:
    """The config's ``key`` as DeepSpeed reads it (case-insensitive; None: unset and no
    ``default``). A value DeepSpeed refuses raises ValueError naming the key."""
    value = (ds_config or {}).get(key, default)
    if value is None:
        return None
    name = value.lower() if isinstance(value, str) else value
    if name not in COMM_BYTES:
        raise ValueError(f"{key} ({value!r}) must be one of {', '.join(map(repr, COMM_BYTES))} or null (DeepSpeed's "
                         "default: the training dtype)")
    return name


def expert_sync_dtype(ds_config: dict | None, *, training: str, sequence_parallel: bool = False) -> str:
    """The expert gradient sync's dtype ("fp32", "bf16" or "fp16") under DeepSpeed config
    ``ds_config`` for ``training`` ("fp32", "bf16" or "fp16": the engine's parameters'), as
    DeepSpeed's engine picks its own (module docstring); ``sequence_parallel``: Ulysses SP is on."""
    if training not in COMM_BYTES:
        raise ValueError(f"training ({training!r}) must be one of {', '.join(map(repr, COMM_BYTES))}")
    name = configured_dtype(ds_config, SP_KEY, "fp32") if sequence_parallel else configured_dtype(ds_config)
    return training if name is None else name


def expert_sync_bytes(ds_config: dict | None, *, training: str, sequence_parallel: bool = False) -> int:
    """Bytes per element of the expert gradient sync (:func:`expert_sync_dtype`)."""
    return COMM_BYTES[expert_sync_dtype(ds_config, training=training, sequence_parallel=sequence_parallel)]

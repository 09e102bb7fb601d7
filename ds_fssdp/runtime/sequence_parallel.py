"""Ulysses sequence parallelism (DeepSpeed's ALST) with FSSDP experts (docs/design.md section 5).

Legend: W ranks in the world, s ranks per sequence-parallel (SP) group, W / s data-parallel
replicas of the sequence.

The mpu ``UlyssesSPAttentionHF.register_with_transformers`` returns is accepted: every rank holds
a slice of each sequence and the MoE layers see only that slice, so FSSDP runs unchanged over all
W ranks. Every SP rank backpropagates the same gathered loss, so the gradients summed over all W
ranks are s times the full sequences'; the expert gradients take DeepSpeed's divisor of the dense
ones (:func:`sp_grad_scale`, measured against DeepSpeed 0.19.8: W / s under ZeRO 0-2, W under ZeRO
3's default reduce-scatter; ZeRO 3's contiguous all-reduce path scales by bucket size and is
refused), so one global norm and clipping see one consistent gradient.
"""
from __future__ import annotations

from ds_fssdp.config import FSSDPConfigError


def is_sequence_parallel_mpu(mpu) -> bool:
    """DeepSpeed's own test for a Ulysses SP mpu (``deepspeed.utils.groups``): it has
    ``initialize_sequence_parallel`` and its SP group getters."""
    return mpu is not None and hasattr(mpu, "initialize_sequence_parallel") and hasattr(
        mpu, "get_sequence_parallel_world_size")


def sequence_parallel_size(ds_config: dict, *, mpu, mesh_param=None) -> int:
    """The SP size s (1 without SP), checked against the config; refuses what FSSDP does not run
    with SP, naming the key. Reads the mpu's group sizes only: no collective."""
    key = ds_config.get("sequence_parallel_size", 1)
    if not isinstance(key, int) or isinstance(key, bool) or key < 1:
        raise FSSDPConfigError(f"sequence_parallel_size ({key!r}) must be an integer >= 1")
    if mesh_param is not None or (key > 1 and "data_parallel_size" in ds_config):
        raise FSSDPConfigError(f"sequence_parallel_size ({key}) with a device mesh (mesh_param {mesh_param!r}, "
                               f"data_parallel_size {ds_config.get('data_parallel_size')!r}) is not supported with "
                               "fssdp; pass the mpu that UlyssesSPAttentionHF.register_with_transformers returns")
    if not is_sequence_parallel_mpu(mpu):
        if key > 1:
            raise FSSDPConfigError(f"sequence_parallel_size ({key}) needs the mpu that UlyssesSPAttentionHF."
                                   "register_with_transformers returns, passed as initialize(mpu=...)")
        return 1
    size = int(mpu.get_sequence_parallel_world_size())
    if "sequence_parallel_size" in ds_config and key != size:
        raise FSSDPConfigError(f"sequence_parallel_size ({key}) differs from the mpu's sequence-parallel group "
                               f"size ({size})")
    tp = ds_config.get("tensor_parallel") or {}
    autotp = tp.get("autotp_size", 0) if isinstance(tp, dict) else 0
    if isinstance(autotp, int) and autotp > 1:
        raise FSSDPConfigError(f"sequence_parallel_size ({size}) with tensor_parallel.autotp_size ({autotp}) is not "
                               "supported with fssdp; use one of the two")
    zero = ds_config.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) == 3 and zero.get("reduce_scatter", True) is False:
        raise FSSDPConfigError(f"sequence_parallel_size ({size}) with zero_optimization.reduce_scatter (false) under "
                               "ZeRO stage 3 is not supported with fssdp: DeepSpeed then scales each dense gradient "
                               "bucket by s or by 1 depending on its size, which the experts cannot follow")
    return size


def sp_grad_scale(ds_config: dict, *, world: int, sp: int) -> float:
    """What the summed expert gradients are multiplied by: DeepSpeed's divisor of the summed dense
    gradients, W / s under ZeRO 0-2 and W under ZeRO 3 (1 / W without SP)."""
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    return 1.0 / world if sp == 1 or stage == 3 else sp / world

"""Checkpoints of an FSSDP engine: DeepSpeed's dense state plus every expert's state keyed by
(layer, expert), never by rank; written atomically, loaded safely, under any owners and world size.
What is saved (format ``ds_fssdp.checkpoint`` version 1), the atomic save and the safe load:
docs/robustness.md, "Checkpoints"; the modules: docs/design.md section 1; pipelines: section 9.
"""
from ds_fssdp.runtime.checkpoint.export import consolidated_state_dict, export_consolidated
from ds_fssdp.runtime.checkpoint.files import CheckpointError, load_file, safe_deepspeed_loading
from ds_fssdp.runtime.checkpoint.files import digest as _digest  # the name tools and tests know
from ds_fssdp.runtime.checkpoint.layout import (COMMON, DS_MODEL_STATES, FORMAT, LATEST, MANIFEST, META, OLD_PREFIX,
                                               TMP_PREFIX, VERSION, rank_file, read_manifest, read_meta, resolve_tag,
                                               verify_files)
from ds_fssdp.runtime.checkpoint.load import check_compatible, load, load_expert_state
from ds_fssdp.runtime.checkpoint.rng import rng_state, set_rng_state
from ds_fssdp.runtime.checkpoint.save import (check_tag, common_state, expert_state, meta_state, rank_state, save, wait,
                                             write_expert_files)

__all__ = ["COMMON", "DS_MODEL_STATES", "FORMAT", "LATEST", "MANIFEST", "META", "OLD_PREFIX", "TMP_PREFIX", "VERSION",
           "CheckpointError", "check_compatible", "check_tag", "common_state", "consolidated_state_dict",
           "expert_state", "export_consolidated", "load", "load_expert_state", "load_file", "meta_state", "rank_file",
           "rank_state", "read_manifest", "read_meta", "resolve_tag", "rng_state", "safe_deepspeed_loading", "save",
           "set_rng_state", "verify_files", "wait", "write_expert_files"]

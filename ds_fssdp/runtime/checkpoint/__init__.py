"""Checkpoints of an FSSDP engine: DeepSpeed's dense state plus every expert's state keyed by
(layer, expert), never by rank; written atomically, loaded safely, under any owners and world size.

One module per job: ``save`` (writing and committing; ``staging`` and ``background`` for an
asynchronous save), ``load`` (checking and loading),
``reshape`` (owners and rows on another world size), ``export`` (the consolidated state dict),
``pipeline`` (experts by global layer index under pipeline parallelism),
over the shared ``layout`` (names, manifest, metadata), ``files`` (atomic writes, digests, the
safe reader), ``collective`` (agreement between ranks) and ``rng``.

Legend: L MoE layers, E experts, D ranks, S rows a rank owns, P elements per expert.

The files of ``<save_dir>/<tag>/`` (format ``ds_fssdp.checkpoint`` version 1): docs/robustness.md,
"What is saved". In bf16/fp16 the compute rows are the master rows cast (the engine keeps them so
after every step), so only the fp32 masters are stored; in fp32 the rows are the masters.

Atomic save: everything is written into ``<save_dir>/.tmp-<tag>``; once every rank has written
and the manifest is complete, rank 0 renames the directory to ``<tag>`` (a previous ``<tag>`` is
moved to ``.old-<tag>`` first and deleted after) and then replaces ``latest`` by an atomic
rename. A save interrupted at any point leaves ``latest`` and the checkpoint it names untouched.
``save_dir`` must be a filesystem every rank sees (as DeepSpeed assumes).

Safe load: every file is checked against the manifest (size always, sha256 with ``verify``),
spread over the ranks, before anything is read into the engine; any bad file fails every rank
with its name. Every ``.pt`` file, DeepSpeed's included, is read with ``weights_only=True``
(DeepSpeed's own loader uses ``weights_only=False``), so loading never runs pickled code; the
few DeepSpeed data classes its ZeRO files hold are allow-listed by name.

Owners after a load: the saved owners when the world size and ``ranks_per_node`` are the same
(exact resume, also after a re-shard); otherwise the homogeneous owners of the new world (the
next re-shard, if configured, re-plans them). Each rank reads the rows of the experts it owns
from whichever files hold them. The predictor's windows are kept; on another world size each
window keeps its per-expert totals (the per-rank split no longer applies). RNG states are
restored per rank when the world size is the same.

Pipeline parallelism (``pipeline``): DeepSpeed writes its per-layer and per-stage files; the
experts are keyed by their global MoE layer index (each stage's ranks write their own layers, the
metadata lists every stage's), so a pipeline checkpoint resumes on another data-parallel size;
another number of stages is refused by name.
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

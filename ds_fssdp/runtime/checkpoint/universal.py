"""The dense part on another world size: DeepSpeed's Universal Checkpoint (docs/robustness.md).

ZeRO 1/2 partition the dense optimizer state (ZeRO 3 the parameters too) by data-parallel rank. On
another world size rank 0 converts the dense part once with DeepSpeed's own ``ds_to_universal``
into ``<load_dir>/.universal-<tag>/universal/`` (written as ``.universal-tmp-<tag>``, renamed when
complete, reused while the checkpoint's manifest is unchanged), which DeepSpeed's engine loads
through ``checkpoint.load_universal``. The experts need none of it (reshape.py). By hand, e.g. on a
read-only checkpoint (then load ``<out>`` with ``checkpoint.load_universal``):

    python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state \
        --input_folder <load_dir>/<tag> --output_folder <out>/universal

DeepSpeed's converter reads the ZeRO files with ``weights_only=False``: they are checked against the
manifest first, but a checkpoint is only as trustworthy as whoever wrote it.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil

from deepspeed import comm as dist
from deepspeed.utils import logger

from ds_fssdp.runtime.checkpoint.collective import agreed
from ds_fssdp.runtime.checkpoint.files import CheckpointError, fsync_dir, patched, read_json, write_file

PREFIX = ".universal-"
TMP_PREFIX = ".universal-tmp-"
TAG = "universal"
SOURCE = "fssdp_source_manifest.json"


def needs_universal(engine, meta: dict, *, dense_optimizer: bool) -> bool:
    """A ZeRO checkpoint of another world size whose dense state is partitioned by rank: the
    optimizer state under ZeRO 1/2 (when loaded), everything under ZeRO 3."""
    if meta["world_size"] == dist.get_world_size() or not engine.zero_optimization() or not meta["zero_stage"]:
        return False  # ZeRO 0 saves the dense state whole
    return dense_optimizer or int(meta["zero_stage"]) >= 3 or engine.zero_optimization_partition_weights()


def check_convertible(meta: dict, root: str, world: int) -> None:
    """DeepSpeed's converter carries the fp32 masters and Adam's two moments only (it reads
    ``exp_avg`` and ``exp_avg_sq`` of every fragment); refuse anything else before converting."""
    optimizer = meta.get("optimizer") or ""
    if "Adam" not in optimizer:
        way_out = ("load with load_optimizer_states=False (dense moments start fresh; every expert's moments load "
                   "with load_expert_optimizer_states=True)" if int(meta["zero_stage"]) < 3 else
                   "resume on the same number of ranks (ZeRO 3 partitions the dense parameters themselves)")
        raise CheckpointError(
            f"{root} was saved on {meta['world_size']} ranks with ZeRO stage {meta['zero_stage']} and optimizer "
            f"{optimizer or None}; loading it on {world} ranks re-partitions the dense state through DeepSpeed's "
            f"universal checkpoint, which supports Adam-family optimizers only: {way_out}")


def convert(load_dir: str, dir_tag: str, manifest: dict) -> tuple:
    """Convert ``<load_dir>/<dir_tag>`` (collective; rank 0 converts unless a conversion of the
    same manifest exists); return DeepSpeed's ``(load_dir, tag)`` of the universal checkpoint."""
    final, tmp = os.path.join(load_dir, PREFIX + dir_tag), os.path.join(load_dir, TMP_PREFIX + dir_tag)
    agreed(f"converting {os.path.join(load_dir, dir_tag)} to a universal checkpoint with DeepSpeed's ds_to_universal "
           f"(or run it by hand, see ds_fssdp/runtime/checkpoint/universal.py)",
           lambda: _convert(os.path.join(load_dir, dir_tag), final, tmp, manifest), root_only=True)
    return final, TAG


def loading_universal(engine):
    """DeepSpeed's engine loads a universal checkpoint while this is active (``checkpoint.load_universal``)."""
    return patched(engine._config, "load_universal_checkpoint", True)


def _convert(src: str, final: str, tmp: str, manifest: dict) -> None:
    if _is_current(final, manifest):
        logger.info(f"fssdp: reusing the universal checkpoint {final}")
        return
    from deepspeed.checkpoint import ds_to_universal
    for path in (tmp, final):
        if os.path.lexists(path):
            shutil.rmtree(path)
    os.makedirs(tmp)
    args = argparse.Namespace(input_folder=src, output_folder=os.path.join(tmp, TAG), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    out = io.StringIO()  # its prints and progress bars go to the log, not to the user's terminal
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        ds_to_universal.main(args)
    logger.debug(f"fssdp: ds_to_universal output: {out.getvalue()}")
    logger.info(f"fssdp: converted the dense part of {src} with DeepSpeed's ds_to_universal into {final}")
    write_file({"files": manifest["files"]}, os.path.join(tmp, SOURCE))
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))


def _is_current(final: str, manifest: dict) -> bool:
    try:  # a missing or unreadable record is a CheckpointError too
        return read_json(os.path.join(final, SOURCE)).get("files") == manifest["files"]
    except CheckpointError:
        return False


"""The checkpoint's layout: file names, the manifest and metadata, and checking files against the
manifest before anything is read."""
from __future__ import annotations

import os

from deepspeed import comm as dist
from deepspeed.utils import logger

from ds_fssdp.runtime.checkpoint.collective import all_gather
from ds_fssdp.runtime.checkpoint.files import CheckpointError, digest, read_json

FORMAT = "ds_fssdp.checkpoint"
VERSION = 1
META = "fssdp/meta.json"
COMMON = "fssdp/common.pt"
MANIFEST = "manifest.json"
DS_MODEL_STATES = "mp_rank_00_model_states.pt"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


def rank_file(rank: int) -> str:
    return f"fssdp/rank{rank:05d}.pt"


def resolve_tag(load_dir: str, tag: str) -> str:
    """The directory holding ``tag``: itself, or ``.old-<tag>`` if a save of the same tag stopped
    between its two renames."""
    if os.path.isdir(os.path.join(load_dir, tag)):
        return tag
    if os.path.isdir(os.path.join(load_dir, OLD_PREFIX + tag)):
        logger.warning(f"fssdp: {os.path.join(load_dir, tag)} is missing (a save of the same tag was interrupted); "
                       f"loading the previous copy {OLD_PREFIX + tag}")
        return OLD_PREFIX + tag
    raise CheckpointError(f"no checkpoint {tag!r} in {load_dir} ({os.path.join(load_dir, tag)} does not exist)")


def read_manifest(root: str) -> dict:
    manifest = read_json(os.path.join(root, MANIFEST))
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{os.path.join(root, MANIFEST)} is not a {FORMAT} manifest (is {root} a ds_fssdp "
                              "checkpoint, saved completely?)")
    return manifest


def read_meta(root: str) -> dict:
    path = os.path.join(root, META)
    meta = read_json(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not {FORMAT} metadata")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has format version {meta.get('version')}; this ds_fssdp reads up to {VERSION}")
    return meta


def verify_files(root: str, manifest: dict, *, digests: bool = True, group_ranks: bool = False) -> None:
    """Every file of the manifest exists with its size (all ranks) and, with ``digests``, its
    sha256 (each rank hashes a share). ``group_ranks``: collective, every rank raises the same."""
    names = sorted(manifest["files"])
    rank, world = (dist.get_rank(), dist.get_world_size()) if group_ranks else (0, 1)
    errors = []
    for i, name in enumerate(names):
        path, want = os.path.join(root, name), manifest["files"][name]
        if not os.path.isfile(path):
            errors.append(f"checkpoint file {path} is missing")
            continue
        size = os.path.getsize(path)
        if size != want["bytes"]:
            errors.append(f"checkpoint file {path} has {size} bytes, the manifest says {want['bytes']} (truncated?)")
        elif digests and i % world == rank:
            got = digest(path, fsync=False)["sha256"]
            if got != want["sha256"]:
                errors.append(f"checkpoint file {path} is corrupted: sha256 {got}, the manifest says {want['sha256']}")
    if group_ranks:
        errors = sorted({e for part in all_gather(errors) for e in part})
    if errors:
        raise CheckpointError("; ".join(errors))

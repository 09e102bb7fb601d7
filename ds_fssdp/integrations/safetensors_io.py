"""safetensors files read and written by byte range: only the experts a rank owns cross the disk.

Legend: E experts, S experts read or written here.

The format (github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header size, the
JSON header (each tensor's dtype, shape and ``data_offsets``), then each tensor row-major, back to
back. A fused expert tensor [E, ...] holds expert e's bytes at ``begin + e * (end - begin) / E``, so
a rank reads (:meth:`CheckpointFiles.read` with ``rows``) or writes (:meth:`ShardFile.write`) exactly
its own experts' bytes; safetensors' own ``safe_open`` maps the whole file and its writer takes every
tensor of a file at once. The files load with safetensors and transformers unchanged. Every problem
names its file and key (missing, unreadable, not safetensors, truncated, a key in two files).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from ds_fssdp.runtime.checkpoint.files import CheckpointError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {v: k for k, v in DTYPES.items()}
METADATA = {"format": "pt"}  # what transformers' loader checks


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: where its bytes are (absolute offset in the file)."""
    path: str
    key: str
    dtype: torch.dtype
    shape: tuple
    begin: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of dim 0 (an expert of a fused [E, ...] tensor)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


def read_header(path: str) -> tuple:
    """``({key: Entry}, metadata)`` of one safetensors file, checked against its size."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if n < 2 or 8 + n > size:
                raise CheckpointError(f"checkpoint file {path} is not a safetensors file (header size {n}, file "
                                      f"{size} bytes)")
            header = json.loads(f.read(n))
    except OSError as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint file {path} has a corrupted safetensors header: {err}") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint file {path} has a corrupted safetensors header")
    metadata = header.pop("__metadata__", None) or {}
    entries, start = {}, 8 + n
    for key, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint file {path}: tensor {key!r} has an unreadable entry {info!r} "
                                  f"({type(err).__name__}: {err})") from None
        numel = math.prod(shape)
        if end - begin != numel * dtype.itemsize:
            raise CheckpointError(f"checkpoint file {path}: tensor {key!r} {info['dtype']} {list(shape)} spans "
                                  f"{end - begin} bytes, not {numel * dtype.itemsize}")
        if start + end > size:
            raise CheckpointError(f"checkpoint file {path} is truncated: tensor {key!r} ends at byte {start + end}, "
                                  f"the file has {size}")
        entries[key] = Entry(path, key, dtype, shape, start + begin, end - begin)
    return entries, metadata


class CheckpointFiles:
    """The tensors of a checkpoint's safetensors files, from their headers (no data read)."""

    def __init__(self, paths):
        self.paths = list(paths)
        self.entries = {}
        for path in self.paths:
            if not str(path).endswith(".safetensors"):
                raise CheckpointError(f"checkpoint file {path} is not safetensors: ds_fssdp reads each rank's own "
                                      "experts from safetensors files only (save the checkpoint with safetensors)")
            for key, entry in read_header(path)[0].items():
                if key in self.entries:
                    raise CheckpointError(f"tensor {key!r} is in two checkpoint files: {self.entries[key].path} "
                                          f"and {path}")
                self.entries[key] = entry

    def keys(self):
        return self.entries.keys()

    def entry(self, key: str) -> Entry:
        if key not in self.entries:
            where = os.path.dirname(self.paths[0]) if self.paths else "?"
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint ({len(self.paths)} safetensors files in "
                                  f"{where})")
        return self.entries[key]

    def read(self, key: str, rows=None) -> torch.Tensor:
        """The tensor ``key`` (CPU), or its indices ``rows`` (ascending) of dim 0 only: the bytes of
        each contiguous run of them, nothing else."""
        e = self.entry(key)
        if rows is None:
            return _read_range(e, e.begin, e.nbytes).view(e.dtype).reshape(e.shape)
        rows = [int(r) for r in rows]
        if not e.shape or any(not 0 <= r < e.shape[0] for r in rows):
            raise CheckpointError(f"{e.path}: tensor {key!r} of shape {list(e.shape)} has no rows {rows}")
        out = torch.empty((len(rows), *e.shape[1:]), dtype=e.dtype)
        flat = out.view(-1).view(torch.uint8) if out.numel() else out
        i = 0
        for first, count in _runs(rows):
            flat[i * e.row_bytes:(i + count) * e.row_bytes].copy_(_read_range(e, e.begin + first * e.row_bytes,
                                                                              count * e.row_bytes))
            i += count
        return out


def _runs(rows: list) -> list:
    """Ascending indices as (first, count) runs of consecutive ones (``r - i`` constant along a run)."""
    runs = (list(run) for _, run in itertools.groupby(enumerate(rows), lambda ir: ir[1] - ir[0]))
    return [(run[0][1], len(run)) for run in runs]


def _read_range(e: Entry, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``e``'s file from ``offset`` (uint8)."""
    try:
        data = np.fromfile(e.path, dtype=np.uint8, count=nbytes, offset=offset)
    except OSError as err:
        raise CheckpointError(f"reading tensor {e.key!r} from {e.path} failed: {err}") from err
    if data.size != nbytes:
        raise CheckpointError(f"checkpoint file {e.path} is truncated: tensor {e.key!r} ends early")
    return torch.from_numpy(data)


@dataclass(frozen=True)
class Planned:
    """A tensor to write: its key, dtype and full shape."""
    key: str
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ShardFile:
    """A safetensors file laid out before any data exists: its header from the planned tensors
    (in order, back to back), the data filled by range from any number of writers."""

    def __init__(self, path: str, tensors: list):
        self.path = path
        header, offset = {"__metadata__": METADATA}, 0
        for t in tensors:
            header[t.key] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
        self.header = struct.pack("<Q", len(raw)) + raw
        self.size = len(self.header) + offset
        self.entries = {t.key: Entry(path, t.key, t.dtype, tuple(t.shape),
                                     len(self.header) + header[t.key]["data_offsets"][0], t.nbytes) for t in tensors}

    def create(self) -> None:
        """Write the header and size the file (one writer, before the others write their ranges)."""
        with open(self.path, "wb") as f:
            f.write(self.header)
            f.truncate(self.size)

    def write(self, key: str, tensor: torch.Tensor, *, first_row: int = 0) -> None:
        """Write ``tensor`` as ``key``'s rows from ``first_row`` on (all of it: 0 and the full
        shape)."""
        e = self.entries[key]
        if tensor.dtype != e.dtype or tuple(tensor.shape[1:]) != e.shape[1:] or \
                first_row + (tensor.shape[0] if tensor.dim() else 1) > (e.shape[0] if e.shape else 1):
            raise ValueError(f"{self.path}: {key} is {NAMES[e.dtype]} {list(e.shape)}; got {tensor.dtype} "
                             f"{list(tensor.shape)} at row {first_row}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        view = memoryview(data.numpy())
        offset = e.begin + first_row * e.row_bytes
        fd = os.open(self.path, os.O_WRONLY)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
        finally:
            os.close(fd)


def plan_shards(tensors: list, *, max_bytes: int) -> list:
    """Consecutive tensors grouped into files of at most ``max_bytes`` of data (a bigger tensor gets
    a file of its own), as transformers shards."""
    shards, size = [], 0
    for t in tensors:
        if not shards or (size + t.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards

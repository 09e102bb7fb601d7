"""Staging a checkpoint in host memory at the step boundary: every file the save would write,
DeepSpeed's included, serialized now into bytes that the background writer puts on disk later.

DeepSpeed writes its part through its checkpoint engine (``engine.checkpoint_engine.save(state,
path)``, the extension point of its decoupled and FastPersist engines). During an asynchronous
save that engine is swapped for :class:`StagingCheckpointEngine`, which serializes each state
with ``torch.save`` into memory (with the serialization the real engine would use) instead of
writing it. DeepSpeed's own ``save_checkpoint`` therefore runs unchanged and synchronously, with
its collectives (tag validation, barriers) and its ZeRO partition logic, on every rank.

Serialized bytes, not tensor copies: the bytes are exactly what a synchronous save writes, they
cannot change when training goes on (a copied dict could still hold live objects: the user's
``client_state``, DeepSpeed's loss scaler, and on the CPU ``tensor.cpu()`` is the tensor itself),
an unpicklable ``client_state`` fails on the spot on every rank, and the background thread only
writes, flushes and hashes memory. Serializing costs about as much as copying the tensors.
"""
from __future__ import annotations

import io
import os
from contextlib import contextmanager

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ds_fssdp.runtime.checkpoint.files import CheckpointError


def serialize(obj, *, zipfile: bool = True) -> memoryview:
    """``torch.save`` into memory; a view of the buffer, not a copy of it."""
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=zipfile)
    return buf.getbuffer()


class StagingCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine during an asynchronous save: ``save`` stages, nothing is
    written (directories are created now, they cost nothing). ``staged``: path -> bytes."""

    def __init__(self, real: TorchCheckpointEngine):
        super().__init__()
        self.name = f"staging({real.name})"
        self.real = real
        self.staged = {}

    def create(self, info):
        return self.real.create(info)

    def save(self, state_dict, path: str):
        self.staged[os.path.abspath(path)] = serialize(state_dict, zipfile=self.real.zipfile_serialization)

    def load(self, path: str, map_location=None):
        raise CheckpointError("cannot load while a checkpoint is being staged")

    def commit(self, info):
        return self.real.commit(info)


def check_stageable(engine) -> None:
    """Asynchronous saves stage through DeepSpeed's plain torch writer; other engines are refused."""
    ce = engine.checkpoint_engine
    if type(ce) is not TorchCheckpointEngine:
        raise CheckpointError(f"async_save=True needs DeepSpeed's torch checkpoint engine, the engine uses "
                              f"{type(ce).__name__} (checkpoint.writer / datastates are not supported with it)")


@contextmanager
def staging_deepspeed(engine):
    """DeepSpeed's ``save_checkpoint`` stages its files into the yielded engine's ``staged``."""
    real = engine.checkpoint_engine
    staging = StagingCheckpointEngine(real)
    engine.checkpoint_engine = staging
    try:
        yield staging
    finally:
        engine.checkpoint_engine = real

"""Staging a checkpoint in host memory at the step boundary (docs/robustness.md, "Saves that don't
stop training"): every state the save would write, DeepSpeed's included, copied now, so that the
background writer writes exactly this step's state while training goes on.

DeepSpeed writes its part through its checkpoint engine (``engine.checkpoint_engine.save(state,
path)``, the extension point of its decoupled and FastPersist engines); during an asynchronous save
it is swapped for :class:`StagingCheckpointEngine`, which keeps a host copy of each state, and
DeepSpeed's ``save_checkpoint`` runs unchanged, with its collectives, on every rank. Copies, not
references: a state dict holds live objects (on the CPU ``tensor.cpu()`` is the tensor itself; the
``client_state``; the loss scaler) that the next steps change.
"""
from __future__ import annotations

import copy
import os

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ds_fssdp.runtime.checkpoint.files import CheckpointError, patched


def to_host(obj, memo=None):
    """A copy of ``obj`` sharing nothing mutable with it: tensors copied to fresh CPU tensors (the
    same tensor twice stays one), dicts, lists and tuples rebuilt, other values deep-copied."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if torch.is_tensor(obj):
        out = obj.detach().to("cpu", copy=True)
    elif isinstance(obj, dict):
        out = type(obj)((k, to_host(v, memo)) for k, v in obj.items())
        if getattr(obj, "__dict__", None):  # an OrderedDict's _metadata (module state dicts)
            out.__dict__.update(copy.deepcopy(obj.__dict__, memo))
    elif isinstance(obj, list):
        out = [to_host(v, memo) for v in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        out = tuple(to_host(v, memo) for v in obj)
    else:
        out = copy.deepcopy(obj, memo)
    memo[id(obj)] = out
    return out


class StagingCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine during an asynchronous save: ``save`` stages a host copy,
    nothing is written (directories are created now, they cost nothing). ``staged``: path -> state,
    to be written by ``real.save``."""

    def __init__(self, real: TorchCheckpointEngine):
        super().__init__()
        self.name = f"staging({real.name})"
        self.real = real
        self.staged = {}

    def create(self, info):
        return self.real.create(info)

    def save(self, state_dict, path: str):
        self.staged[os.path.abspath(path)] = to_host(state_dict)

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


def staging_deepspeed(engine):
    """DeepSpeed's ``save_checkpoint`` stages its files into the yielded engine's ``staged``."""
    return patched(engine, "checkpoint_engine", StagingCheckpointEngine(engine.checkpoint_engine))

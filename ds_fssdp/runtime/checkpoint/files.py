"""Checkpoint files: writes flushed to disk, atomic text replacement, digests, the safe reader
(``torch.load(weights_only=True)`` plus DeepSpeed's plain data classes), and write failures (a full
disk, a size limit) reported with the file's path and the space left, on every rank alike; and
:func:`patched`, how a save or load changes a DeepSpeed or transformers object for its duration."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import resource
import shutil
from contextlib import ExitStack, contextmanager, nullcontext

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file."""


def load_file(path: str, *, map_location="cpu", mmap: bool = False):
    """``torch.load`` with ``weights_only=True`` (plus DeepSpeed's plain data classes); any failure
    is a :class:`CheckpointError` naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        with _allowed(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint file {path} was refused by the safe loader (weights_only=True: it holds "
                              f"objects whose unpickling could run code): {_first_line(err)}") from err
    except Exception as err:  # torch reports truncation and corruption with several types
        raise CheckpointError(f"checkpoint file {path} cannot be read (truncated or corrupted?): "
                              f"{type(err).__name__}: {_first_line(err)}") from err


@contextmanager
def patched(obj, name: str, value):
    """``obj.name`` is ``value`` while this is active; then its own attribute is back (or gone, when
    it had none: the class's shows again)."""
    own = vars(obj).get(name, _NONE)
    setattr(obj, name, value)
    try:
        yield value
    finally:
        if own is _NONE:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


_NONE = object()


def safe_deepspeed_loading(engine):
    """DeepSpeed's checkpoint engine reads with :func:`load_file` while this is active."""
    return patched(engine.checkpoint_engine, "load",
                   lambda path, map_location=None: load_file(path, map_location=map_location))


def _allowed(classes: list):
    if hasattr(torch.serialization, "safe_globals"):
        return torch.serialization.safe_globals(classes)
    torch.serialization.add_safe_globals(classes)  # torch 2.4: a process-wide allow-list
    return nullcontext()


def _deepspeed_safe_globals() -> list:
    """Classes DeepSpeed's ZeRO checkpoints pickle: plain data (a dataclass, an enum, loss scalers)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [fragment_address, ZeroStageEnum, LossScaler, DynamicLossScaler]


def _first_line(err) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def write_file(obj, path: str) -> None:
    """``obj`` written and flushed to disk: a str as text, JSON into ``*.json``, else ``torch.save``."""
    text = isinstance(obj, str) or path.endswith(".json")
    with reported_write(path), open(path, "w" if text else "wb") as f:
        if isinstance(obj, str):
            f.write(obj)
        elif text:
            json.dump(obj, f, indent=1)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def reported_write(path: str):
    """A failed write (``OSError``; torch's writer turns a full disk into a ``RuntimeError``) becomes
    a :class:`CheckpointError` naming ``path``, the reason and the space left on its filesystem."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        raise write_failure(path, err) from err


def write_failure(path: str, err: BaseException) -> CheckpointError:
    """torch's writer reports a full disk only as ``unexpected pos``: say what the disk and the
    process's file size limit look like."""
    reason = os.strerror(err.errno) if isinstance(err, OSError) and err.errno else _first_line(err)
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        where = f"{free:,} bytes free there" + (" (the disk is full)" if free == 0 else "")
    except OSError:
        where = "free space unknown"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        where += f"; this process may write files of at most {limit:,} bytes (RLIMIT_FSIZE)"
    return CheckpointError(f"writing checkpoint file {path} failed: {reason}; {where}")


@contextmanager
def deferred_write_errors(engine):
    """DeepSpeed's writes (its checkpoint engine's ``save`` and the recovery scripts it copies under
    ZeRO) record a failure instead of raising it, and skip the writes after it, so DeepSpeed's own
    save still reaches its barriers on every rank (a rank raising out of it would leave the others
    waiting there); the caller agrees on the list."""
    errors = []

    def deferred(write, path_of):
        def run(*args, **kwargs):
            if errors:
                return
            try:
                write(*args, **kwargs)
            except (OSError, RuntimeError) as err:
                errors.append(write_failure(path_of(*args, **kwargs), err))
        return run

    wrapped = [(engine.checkpoint_engine, "save", lambda state_dict, path: path),
               (engine, "_copy_recovery_script", lambda save_path: os.path.join(save_path, "zero_to_fp32.py"))]
    with ExitStack() as stack:
        for obj, name, path_of in wrapped:
            stack.enter_context(patched(obj, name, deferred(getattr(obj, name), path_of)))
        yield errors


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read (truncated or corrupted?): {err}") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint file {path} does not hold a JSON object")
    return value


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err


def atomic_write_text(path: str, text: str) -> None:
    write_file(text, path + ".tmp")
    os.replace(path + ".tmp", path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def walk(root: str) -> list:
    return [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]


def digest(path: str, *, fsync: bool = True) -> dict:
    """Size and sha256; ``fsync``: also flush the file to disk (DeepSpeed's writer does not)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}

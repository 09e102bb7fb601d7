"""Routing traces on disk: per iteration, per MoE layer, ``tokens_ED`` (docs/traces.md).

Legend: S steps (iterations), L MoE layers, E experts, D ranks.

A trace is ``NAME.npz`` holding ``tokens`` (int32 [S, L, E, D]: assignments from rank d to expert e
in layer l at step s) and optional per-step arrays (``loss``, ``aux``, ...), plus a JSON sidecar
``NAME.json`` with metadata. /work/shared/data/trace_e8.npz is in this format. Writes are atomic
(temporary file, then ``os.replace``), so a reader never sees half a file, even while the runtime
is appending to a trace during training.

This module uses numpy only (no torch), so the runtime can import it cheaply.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

FORMAT = "ds-fssdp-trace"
VERSION = 1


@dataclass
class Trace:
    tokens_SLED: np.ndarray  # int32 [S, L, E, D]
    meta: dict = field(default_factory=dict)
    arrays: dict = field(default_factory=dict)  # other arrays from the npz (loss, aux, ...)

    def __post_init__(self):
        if self.tokens_SLED.ndim != 4:
            raise ValueError(f"trace tokens must be [steps, layers, experts, ranks], got shape "
                             f"{tuple(self.tokens_SLED.shape)}")
        if self.tokens_SLED.size and int(self.tokens_SLED.min()) < 0:
            raise ValueError(f"trace tokens must be >= 0 (min {int(self.tokens_SLED.min())})")

    @property
    def steps(self) -> int:
        return self.tokens_SLED.shape[0]

    @property
    def num_layers(self) -> int:
        return self.tokens_SLED.shape[1]

    @property
    def num_experts(self) -> int:
        return self.tokens_SLED.shape[2]

    @property
    def num_ranks(self) -> int:
        return self.tokens_SLED.shape[3]

    @property
    def top_k(self) -> int | None:
        """From the metadata (``top_k``, or ``model.top_k`` as in the shared trace's sidecar)."""
        k = self.meta.get("top_k", (self.meta.get("model") or {}).get("top_k"))
        return int(k) if k is not None else None

    def load_SLE(self) -> np.ndarray:
        return self.tokens_SLED.sum(3, dtype=np.int64)

    def share_std(self) -> float:
        """Routing skew as the paper's Figure 16a reports it: the std over experts of each
        expert's share of a layer's assignments, averaged over steps and layers."""
        return share_std(self.load_SLE())

    def slice(self, start: int, count: int | None = None) -> "Trace":
        end = self.steps if count is None else start + count
        if not 0 <= start < end <= self.steps:
            raise ValueError(f"trace steps [{start}, {end}) outside [0, {self.steps})")
        arrays = {k: v[start:end] if v.ndim and v.shape[0] == self.steps else v for k, v in self.arrays.items()}
        return Trace(self.tokens_SLED[start:end], dict(self.meta, sliced_from=[start, end]), arrays)


def share_std(load_SLE: np.ndarray) -> float:
    load_SLE = np.asarray(load_SLE, dtype=np.float64)
    total_SL = load_SLE.sum(2, keepdims=True)
    share_SLE = np.divide(load_SLE, total_SL, out=np.zeros_like(load_SLE), where=total_SL > 0)
    return float(share_SLE.std(2).mean())


def sidecar_path(path: str) -> str:
    return os.path.splitext(npz_path(path))[0] + ".json"


def npz_path(path: str) -> str:
    return path if path.endswith(".npz") else path + ".npz"


def load_trace(path: str) -> Trace:
    """Read ``path`` (.npz; the .json sidecar is optional)."""
    path = npz_path(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace file {path!r} does not exist")
    with np.load(path) as z:
        if "tokens" not in z.files:
            raise ValueError(f"trace {path!r} has no 'tokens' array (arrays: {z.files})")
        tokens = z["tokens"]
        arrays = {k: z[k] for k in z.files if k != "tokens"}
    meta = {}
    side = sidecar_path(path)
    if os.path.exists(side):
        with open(side, encoding="utf-8") as f:
            meta = json.load(f)
    return Trace(tokens.astype(np.int32, copy=False), meta, arrays)


def save_trace(path: str, trace: Trace) -> None:
    """Write ``trace`` atomically (npz, then its sidecar)."""
    path = npz_path(path)
    S, L, E, D = trace.tokens_SLED.shape
    meta = dict(trace.meta, format=FORMAT, version=VERSION, steps=S, num_layers=L, num_experts=E, num_ranks=D)
    _atomic_write(path, lambda f: np.savez(f, tokens=trace.tokens_SLED.astype(np.int32), **trace.arrays))
    _atomic_write(sidecar_path(path), lambda f: f.write(json.dumps(meta, indent=1, sort_keys=True).encode()))


def _atomic_write(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class TraceWriter:
    """Append one iteration at a time; the file on disk is always a complete trace.

        with TraceWriter("run/trace.npz", meta={"top_k": 2, "tokens_per_rank": 4096}) as w:
            for step in ...:
                w.append(tokens_LED, loss=loss)   # tokens_LED: [L, E, D] ints (numpy or torch)

    The whole trace is rewritten every ``flush_every`` appends and on close (a trace of S steps
    costs O(S) memory; rewriting keeps every flushed file valid on its own)."""

    def __init__(self, path: str, *, meta: dict | None = None, flush_every: int = 50):
        if flush_every < 1:
            raise ValueError(f"TraceWriter flush_every ({flush_every}) must be >= 1")
        self.path = npz_path(path)
        self.meta = dict(meta or {})
        self.flush_every = flush_every
        self._tokens, self._scalars, self._arrays, self._unflushed = [], {}, {}, 0

    def append(self, tokens_LED, *, arrays: dict | None = None, **scalars) -> None:
        """``arrays``: per-step arrays of a fixed shape (the runtime's decision record), stacked
        over steps; ``scalars``: per-step numbers (``loss``)."""
        tokens_LED = np.asarray(tokens_LED.cpu() if hasattr(tokens_LED, "cpu") else tokens_LED)
        if tokens_LED.ndim != 3:
            raise ValueError(f"TraceWriter.append: tokens_LED must be [layers, experts, ranks], got shape "
                             f"{tuple(tokens_LED.shape)}")
        if self._tokens and tokens_LED.shape != self._tokens[0].shape:
            raise ValueError(f"TraceWriter.append: tokens_LED shape {tuple(tokens_LED.shape)} differs from the "
                             f"first step's {tuple(self._tokens[0].shape)}")
        if set(scalars) != set(self._scalars) and self._tokens:
            raise ValueError(f"TraceWriter.append: scalars {sorted(scalars)} differ from the first step's "
                             f"{sorted(self._scalars)}")
        arrays = {k: np.asarray(v) for k, v in (arrays or {}).items()}
        if self._tokens and set(arrays) != set(self._arrays):
            raise ValueError(f"TraceWriter.append: arrays {sorted(arrays)} differ from the first step's "
                             f"{sorted(self._arrays)}")
        step = len(self._tokens)
        self._tokens.append(tokens_LED.astype(np.int32))
        for key, value in scalars.items():
            self._scalars.setdefault(key, [None] * step).append(float(value))
        for key, value in arrays.items():
            self._arrays.setdefault(key, []).append(value)
        self._unflushed += 1
        if self._unflushed >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._tokens:
            return
        arrays = {k: np.asarray(v, dtype=np.float32) for k, v in self._scalars.items()}
        arrays.update({k: np.stack(v) for k, v in self._arrays.items()})
        save_trace(self.path, Trace(np.stack(self._tokens), self.meta, arrays))
        self._unflushed = 0

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

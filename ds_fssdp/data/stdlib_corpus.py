"""A real byte-level corpus every machine has: the source files of CPython's standard library.

Legend: N bytes in the corpus, B batch, S sequence.
"""
from __future__ import annotations

import os
import sysconfig

import torch


def stdlib_files(root: str | None = None) -> list:
    """Sorted ``.py`` files of the standard library (installed packages excluded)."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")
    return files


def load_corpus(max_bytes: int = 16 << 20, root: str | None = None) -> torch.Tensor:
    """The concatenated bytes (uint8 [N]) of the first ``max_bytes`` of the standard library."""
    chunks, total = [], 0
    for path in stdlib_files(root):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def split(corpus_N: torch.Tensor, val_fraction: float = 0.05) -> tuple:
    cut = int(corpus_N.numel() * (1 - val_fraction))
    return corpus_N[:cut], corpus_N[cut:]


def sample_batch(corpus_N: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> tuple:
    """Random windows: inputs and next-byte targets, long [B, S] each."""
    return windows(corpus_N, torch.randint(0, corpus_N.numel() - seq_len - 1, (batch, ), generator=gen), seq_len)


def windows(corpus_N: torch.Tensor, starts_B: torch.Tensor, seq_len: int) -> tuple:
    """The windows from ``starts_B``: inputs and next-byte targets, long [B, S] each."""
    seq = corpus_N[starts_B[:, None] + torch.arange(seq_len + 1)].long()
    return seq[:, :-1], seq[:, 1:]

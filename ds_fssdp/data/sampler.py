"""A resumable stream of random training windows over a corpus, shared by all ranks.

Sample i of the stream is a window whose start depends only on (seed, i), so the stream's whole
state is one integer, ``position`` (samples consumed by all ranks together): saved in a
checkpoint's ``client_state``, it continues at the exact next sample after a restart, also on
another world size (the global batch is then cut into other per-rank slices, but no sample is
seen twice or skipped).

Legend: N bytes in the corpus, B batch, S sequence.
"""
from __future__ import annotations

import torch

from ds_fssdp.data.stdlib_corpus import windows

BLOCK = 4096  # starts drawn per generator seeding: sample i is entry i % BLOCK of block i // BLOCK


class WindowSampler:

    def __init__(self, corpus_N: torch.Tensor, seq_len: int, *, seed: int):
        if corpus_N.numel() <= seq_len + 1:
            raise ValueError(f"seq_len ({seq_len}) must be shorter than the corpus ({corpus_N.numel()} bytes) - 1")
        self.corpus_N, self.seq_len, self.seed = corpus_N, seq_len, seed
        self.position = 0
        self._block = (None, None)

    def next_batch(self, batch: int, *, rank: int, world: int) -> tuple:
        """This rank's ``batch`` windows of the next global batch (``world * batch`` samples): inputs
        and next-byte targets, long [B, S] each. Every rank calls it once per micro-step."""
        return self.next_batches(batch, ranks=[rank], world=world)[0]

    def next_batches(self, batch: int, *, ranks: list, world: int) -> list:
        """:meth:`next_batch` of each of ``ranks`` from the same next global batch (advanced once):
        a pipeline feeds the micro-batches of several data-parallel ranks."""
        out = []
        for rank in ranks:
            first = self.position + rank * batch
            out.append(windows(self.corpus_N, torch.stack([self._start(i) for i in range(first, first + batch)]),
                               self.seq_len))
        self.position += world * batch
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the saved sampler's {key} ({state[key]}) differs from this run's "
                                 f"({getattr(self, key)}): the data stream would not continue")
        self.position = int(state["position"])

    def _start(self, i: int) -> torch.Tensor:
        block, starts = self._block
        if block != i // BLOCK:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i // BLOCK)
            starts = torch.randint(0, self.corpus_N.numel() - self.seq_len - 1, (BLOCK, ), generator=gen)
            self._block = (i // BLOCK, starts)
        return starts[i % BLOCK]

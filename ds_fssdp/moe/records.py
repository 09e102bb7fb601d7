"""What each forward in flight recorded for its own backward, per layer, first in first out
(docs/design.md section 9, "Per micro-batch").

Legend: R replica rows, P elements per expert.

One :class:`MicroRecord` holds what one micro-batch's forwards leave for their backward (the route
and replicas an activation-checkpoint recompute replays, the layout RM gathers again, the replica
reduces to expect, the replica buffers kept alive). Without pipeline parallelism every forward
between two backwards shares one record (created on first use). Under DeepSpeed's pipeline engine
each training forward is declared (:meth:`MicrobatchRecords.begin_forward`) and gets its own; the
backward in progress works on the oldest (:meth:`backward_record`) and :meth:`end_backward` drops
it. Inside one record the recomputes replay its iterations last first. No decisions and no
communication here.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class MicroRecord:
    """One micro-batch's forward, for its backward."""
    iterations: list = field(default_factory=list)  # ShardedExperts' _Iteration per recorded forward
    expected: int = 0  # replica reduces its backward will start (one per hooked or RM forward)
    remat: tuple | None = None  # RM: (layout, SparseAllGather or None) gathered again for the backward
    remat_buffer: object = None  # RM: the re-gathered replicas, once fetched (reused by a recompute)


class MicrobatchRecords:
    """One layer's records in flight, oldest first."""

    def __init__(self):
        self._queue = deque()
        self._declared = False  # begin_forward was called: the next record is a new one

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)

    def begin_forward(self) -> None:
        """A new micro-batch's training forward starts (the pipeline engine's ForwardPass): what it
        records goes into a record of its own, created when it first records something."""
        self._declared = True

    def forward_record(self) -> MicroRecord:
        """The record of the forward running now (created here when it is new)."""
        if self._declared or not self._queue:
            self._queue.append(MicroRecord())
            self._declared = False
        return self._queue[-1]

    def current(self) -> MicroRecord | None:
        """The newest record, without creating one (None when there is none)."""
        return self._queue[-1] if self._queue else None

    def backward_record(self) -> MicroRecord | None:
        """The record of the backward running now: the oldest forward in flight (None: no
        forward recorded anything)."""
        return self._queue[0] if self._queue else None

    def end_backward(self) -> MicroRecord | None:
        """The backward is done: its record is dropped (returned)."""
        return self._queue.popleft() if self._queue else None

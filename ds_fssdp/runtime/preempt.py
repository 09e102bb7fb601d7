"""Preemption: on SIGTERM or SIGUSR1 (how SLURM, Kubernetes and spot instances announce the end)
the loop finishes the step it is in, every rank agrees to stop after the same step, saves, and
exits 0. Opt-in:

    preemption = ds_fssdp.Preemption(grace_s=120).install()   # when the loop starts, not before
    for step in range(start, steps):
        ...                                                   # the step
        if preemption.stop_now():                             # collective: one small all-reduce
            ds_fssdp.save_step(engine, save_dir, step + 1, ...)
            break

The handler only records the signal: a step in flight is never interrupted, and every rank learns
at ``stop_now`` whether any rank got one (a scheduler may signal only some). Install it when the
loop starts: a worker still starting up keeps the default action, so a launcher's SIGTERM ends it
at once instead of waiting for a step that will never come. Further signals while stopping or
saving are recorded and ignored (the save is atomic anyway). ``grace_s``: if the job has not left
``grace_s`` seconds after the first signal, it exits with ``EXIT_GRACE_EXPIRED`` (the previous
checkpoint stays the latest), rather than be killed without a word.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import torch
from deepspeed import comm as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_GRACE_EXPIRED = 75  # EX_TEMPFAIL: "try again later"


class Preemption:

    def __init__(self, *, signals=SIGNALS, grace_s: float | None = None, group=None, device="cpu"):
        if grace_s is not None and not grace_s > 0:
            raise ValueError(f"grace_s ({grace_s}) must be > 0 (or None: no deadline)")
        self.signals, self.grace_s, self.group, self.device = tuple(signals), grace_s, group, device
        self.received = []  # (signal number, monotonic time) in arrival order
        self.stopping = False
        self._previous = {}
        self._deadline = None

    def install(self) -> "Preemption":
        """Take over the signals (main thread only, as Python requires)."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._deadline is not None:
            self._deadline.cancel()

    @property
    def requested(self) -> bool:
        """This rank got a signal (the others may not have)."""
        return bool(self.received)

    def stop_now(self) -> bool:
        """Collective, after each step: True on every rank when any rank got a signal."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.stopping = self.stopping or bool(flag.item())
        return self.stopping

    def _handle(self, signum, frame):
        first = not self.received
        self.received.append((signum, time.monotonic()))
        name = signal.Signals(signum).name
        if first:
            _say(f"fssdp: {name} received; stopping after the current step and saving a checkpoint")
            if self.grace_s is not None:
                self._deadline = threading.Timer(self.grace_s, self._expire)
                self._deadline.daemon = True
                self._deadline.start()
        else:
            _say(f"fssdp: {name} received again; already stopping (ignored)")

    def _expire(self):
        _say(f"fssdp: the preemption grace time ({self.grace_s} s) is over before the job finished saving; "
             f"exiting with {EXIT_GRACE_EXPIRED} (the previous checkpoint stays the latest)")
        os._exit(EXIT_GRACE_EXPIRED)


def _say(text: str) -> None:
    # A signal handler may run inside a print or a logging call: write to the file descriptor.
    os.write(2, (text + "\n").encode())

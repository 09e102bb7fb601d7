"""This process's resident host memory (Linux /proc): current and peak, and the rise of the peak
over a block of code, for the memory benchmarks and tests (benchmarks/load_memory.py,
tests/test_hf_big_model.py).

The peak (VmHWM) counts every page the process held at once, file-backed ones (memory maps)
included. :class:`PeakRise` resets it to the current resident size first (``clear_refs`` 5, after
giving freed heap memory back with ``malloc_trim``, so that memory the allocator merely kept is not
counted as held), and reports how far it rose.
"""
from __future__ import annotations

import ctypes
import gc
import time


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size (``VmRSS``, ``VmHWM``, ``RssAnon``, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no {field}")


class PeakRise:
    """``with PeakRise() as m: ...`` then ``m.rise`` (bytes the peak rose above the start) and
    ``m.seconds``."""

    def __enter__(self):
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.base, self.t0 = status_bytes("VmRSS"), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.rise, self.seconds = status_bytes("VmHWM") - self.base, time.perf_counter() - self.t0

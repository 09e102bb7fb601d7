"""Light timings of one layer's token exchanges and expert GEMM, forward and backward: what the
stage refits its schedule cost model from (``runtime/costfit.py``).

Legend: R rows, H hidden, D ranks.

A span is two clock readings: ``perf_counter`` on the host, CUDA events on a GPU (read only when
the samples are collected, so nothing here synchronises the device). The forward span is timed
around the call; the backward span from a gradient hook on the output (the backward reaches the
call) to an identity autograd stamp on the input (the call's backward is done; the stamp's
output is used only inside the call).

Kinds and their units:

* ``a2a``: one uneven all-to-all (forward or backward), units (intra_bytes, inter_bytes): the
  larger of what this rank sends and receives over that link class (itself excluded);
* ``gemm_fwd``, ``gemm_bwd``: the grouped expert MLP, units (rows,);
* ``layer_fwd``, ``layer_bwd``: the layer's dispatch + expert compute + combine, units
  (intra_bytes, inter_bytes, local_rows, remote_rows, other_fwd_intra_bytes, other_fwd_inter_bytes,
  other_bwd_intra_bytes, other_bwd_inter_bytes) (``planner.schedule.LayerLoad``'s fields, in its
  order: the last four are the other collectives in flight during each direction, the replicas'
  sparse collectives the layer passes in, ``moe/sharded.py``), and where the layer computes its
  block's shared experts beside the exchange, ``relay_bytes`` (0) and ``side_rows``;
* ``compute_fwd``, ``compute_bwd``: the same span less the exchanges inside it, units (rows,):
  the layer's work on the compute stream (the permutations, the grouped MLP, the combine), what
  the schedule's ``gemm`` cost stands for (``runtime/costfit.py``).
"""
from __future__ import annotations

import time
from collections import deque

import torch

KINDS = ("a2a", "gemm_fwd", "gemm_bwd", "layer_fwd", "layer_bwd", "compute_fwd", "compute_bwd")


def _now(device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _seconds(start, end, minus=()) -> float:
    """Seconds from ``start`` to ``end``, less the ``minus`` spans (start, end) inside it."""
    if isinstance(start, float):
        return end - start - sum(e - s for s, e in minus)
    end.synchronize()
    return (start.elapsed_time(end) - sum(s.elapsed_time(e) for s, e in minus)) / 1e3


class _Stamp(torch.autograd.Function):
    """Identity; its backward calls ``hook(clock reading)``."""

    @staticmethod
    def forward(ctx, x, hook):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.hook(_now(g.device))
        return g, None


class LayerTimings:
    """The last ``capacity`` spans of each kind of one layer on this rank."""

    def __init__(self, *, rank: int, ranks_per_node: int, capacity: int = 64, enabled: bool = True):
        self.rank = rank
        self.ranks_per_node = ranks_per_node
        self.spans = {k: deque(maxlen=capacity) for k in KINDS}  # (units, start, end[, minus])
        self._a2a_seen = 0  # exchanges recorded so far (spans["a2a"] keeps the last ``capacity``)
        # Off: every method runs its function untimed (the stage builds its layers with it off when no
        # refit reads the spans: fixed degrees, costs from fssdp.hardware, cost_refresh_interval 0).
        self.enabled = enabled

    def samples(self, kind: str) -> list:
        """[(units, seconds)] of ``kind``, oldest first."""
        return [(u, _seconds(*span)) for u, *span in self.spans[kind]]

    def clear(self) -> None:
        for q in self.spans.values():
            q.clear()

    # -- units ---------------------------------------------------------------------------------
    def link_bytes(self, send_splits: list, recv_splits: list, row_bytes: int) -> tuple:
        """(intra, inter) bytes: the larger of sent and received rows over each link class."""
        node = self.rank // self.ranks_per_node
        sent, recv = [0, 0], [0, 0]
        for d, (s, r) in enumerate(zip(send_splits, recv_splits)):
            if d == self.rank:
                continue
            c = int(d // self.ranks_per_node != node)
            sent[c] += int(s)
            recv[c] += int(r)
        return tuple(float(max(a, b) * row_bytes) for a, b in zip(sent, recv))

    # -- spans ---------------------------------------------------------------------------------
    def timed(self, fn, x: torch.Tensor, units: tuple, forward_kind: str, backward_kind: str | None, *,
              compute=None):
        """``fn(x)`` with its forward span recorded, and (when it builds a graph) its backward span.
        ``compute``: (rows, forward kind, backward kind) to record each span less its exchanges too."""
        box = {}

        def record(kind, start, end, seen):
            self.spans[kind].append((units, start, end))
            self._a2a_seen += kind == "a2a"
            if compute is not None:
                inside = [(s, e) for _, s, e in list(self.spans["a2a"])[max(0, len(self.spans["a2a"]) -
                                                                             (self._a2a_seen - seen)):]]
                self.spans[compute[1 if kind == forward_kind else 2]].append(((compute[0],), start, end, inside))

        if backward_kind is not None and x.requires_grad:
            def done(t):
                if "start" in box:
                    start, seen = box.pop("start")
                    record(backward_kind, start, t, seen)
            x = _Stamp.apply(x, done)
        t0, seen = _now(x.device), self._a2a_seen
        y = fn(x)
        record(forward_kind, t0, _now(y.device), seen)
        if backward_kind is not None and y.requires_grad:
            # A hook, not a stamp: the output stays the caller's own tensor (a custom Function's
            # output is a view that in-place code downstream may not modify).
            y.register_hook(lambda g: box.__setitem__("start", (_now(g.device), self._a2a_seen)))
        return y

    def exchange(self, fn, x_RH: torch.Tensor, out_splits: list, in_splits: list) -> torch.Tensor:
        """``fn(x_RH)``, an all-to-all sending ``in_splits`` rows and receiving ``out_splits``."""
        if not self.enabled:
            return fn(x_RH)
        units = self.link_bytes(in_splits, out_splits, x_RH.shape[1] * x_RH.element_size())
        return self.timed(fn, x_RH, units, "a2a", "a2a")

    def expert_fn(self, expert_fn):
        """The expert function (rows grouped by local expert, group sizes) -> rows, timed."""
        if not self.enabled:
            return expert_fn
        return lambda x_RH, group_sizes: self.timed(lambda x: expert_fn(x, group_sizes), x_RH,
                                                    (float(x_RH.shape[0]),), "gemm_fwd", "gemm_bwd")

    def layer(self, fn, x_TH: torch.Tensor, route, *, other=None, side_rows: float = 0.0) -> torch.Tensor:
        """``fn(x_TH)``: the layer's dispatch, compute and combine over ``route``. ``other``: a
        callable, called right before the forward span starts, returning the bytes of other
        collectives in flight during the forward and the backward, (fwd intra, fwd inter, bwd
        intra, bwd inter) (:meth:`link_bytes` of each); None: none. ``side_rows``: the work beside
        the exchange inside the span, in expert rows (``LayerLoad.side_rows``; appended to the
        layer's units after a 0 relay, and counted with the compute's rows)."""
        if not self.enabled:
            return fn(x_TH)
        other = (0.0, 0.0, 0.0, 0.0) if other is None else tuple(other())
        if len(other) != 4:
            raise ValueError(f"other: (fwd intra, fwd inter, bwd intra, bwd inter) bytes, got {other!r}")
        intra, inter = self.link_bytes(route.send_splits, route.recv_splits, x_TH.shape[1] * x_TH.element_size())
        local = float(route.recv_splits[self.rank])
        units = (intra, inter, local, float(sum(route.recv_splits)) - local, *(float(b) for b in other))
        if side_rows:
            units += (0.0, float(side_rows))
        return self.timed(fn, x_TH, units, "layer_fwd", "layer_bwd",
                          compute=(units[2] + units[3] + float(side_rows), "compute_fwd", "compute_bwd"))

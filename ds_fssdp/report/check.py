"""Offline check of a run's decisions: ``python -m ds_fssdp.report RUN --check``.

Legend: S trace rows (training forwards), L MoE layers.

The replay (``report/replay.py``) derives every decision of every layer and training forward
from the trace's inputs; :func:`compare` lays them beside the runtime's record, and
:func:`check` names the first (iteration, layer, array) that differs, or counts the decisions it
checked. A trace the replay cannot derive the runtime's decisions from is refused by name
(:class:`CheckRefused`), never passed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_fssdp.report.replay import STEP_INPUTS, Replay, ReplaySettings, replay
from ds_fssdp.sim.traces import Trace


class CheckRefused(ValueError):
    """The trace does not hold what the replay needs to derive the runtime's decisions."""


@dataclass(frozen=True)
class CheckResult:
    checked: int  # (iteration, layer, array) decisions compared
    rows: int
    layers: int
    arrays: list  # the decision arrays compared
    reshard_steps: list  # the optimizer steps after which the replay re-sharded
    first: tuple | None  # (iteration, layer, array) of the first difference; None: none
    pipeline_stage: tuple | None = None  # (stage, stages, global layers) of a pipelined run's trace

    def lines(self) -> list:
        if self.first is not None:
            it, layer, key = self.first
            return [f"decision differs: iteration {it}, layer {layer}, array {key}"]
        stage = []
        if self.pipeline_stage is not None:
            s, n, layers = self.pipeline_stage
            stage = [f"pipeline stage {s} of {n}: MoE layers {layers} (layer i here is the stage's i-th)"]
        return stage + [f"checked {self.checked} decisions ({self.rows} iterations x {self.layers} layers x "
                f"{len(self.arrays)} arrays; re-shards after optimizer steps {self.reshard_steps}): all equal to "
                f"the decisions derived from the trace's inputs"]


def compare(trace: Trace, rep: Replay) -> list:
    """Where the derived decisions differ from the recorded ones: ``(key, iteration, layer)`` of
    every key's first difference ([] when the runtime made exactly the replay's decisions)."""
    diffs = []
    for key, want in rep.decisions.items():
        got = trace.arrays.get(key)
        if got is None:
            diffs.append((key, None, None))
            continue
        if got.shape != want.shape:
            diffs.append((key, 0, 0))
            continue
        same = got == want
        if np.issubdtype(want.dtype, np.floating):  # nan: no budget, no window
            same |= np.isnan(got) & np.isnan(want)
        bad = np.argwhere(~same.reshape(same.shape[0], same.shape[1], -1).all(2))
        if bad.size:
            diffs.append((key, int(bad[0, 0]), int(bad[0, 1])))
    return diffs


def first_difference(diffs: list, order: list) -> tuple | None:
    """The earliest ``(iteration, layer, array)`` among :func:`compare`'s (arrays in ``order``)."""
    if not diffs:
        return None
    key, it, layer = min(diffs, key=lambda d: (-1 if d[1] is None else d[1], -1 if d[2] is None else d[2],
                                              order.index(d[0])))
    return it, layer, key


def refusal(trace: Trace, settings: ReplaySettings) -> str | None:
    """Why the replay cannot derive this trace's decisions (None: it can)."""
    missing = [k for k in ("decision_owner", *STEP_INPUTS) if k not in trace.arrays]
    if missing:
        return (f"the trace records no {', '.join(missing)} (not written by the runtime's fssdp.trace_path, or "
                "before its inputs were recorded): nothing to check against")
    start = int(trace.arrays["optimizer_step"][0]) if trace.steps else 0
    if start:
        return (f"the trace starts after optimizer step {start} (a run resumed from a checkpoint): the load "
                "history and the owners it started from are the checkpoint's, not in the trace")
    if settings.notes:
        return "the trace lacks what the run decided with: " + "; ".join(settings.notes)
    moves = settings.reshard_interval or settings.policy == "smartmoe"
    if settings.fssdp_groups > 1 and moves and "reshard_world_load" not in trace.arrays:
        return (f"the run re-shards on loads summed over its {settings.fssdp_groups} FSSDP groups (fssdp.group_size "
                "below the world), the trace holds rank 0's group's counts and no reshard_world_load (written "
                "before it was recorded)")
    return None


def check(trace: Trace) -> CheckResult:
    """Derive the decisions from ``trace``'s inputs and compare them with its record."""
    settings = ReplaySettings.from_trace(trace)
    why = refusal(trace, settings)
    if why is not None:
        raise CheckRefused(why)
    rep = replay(trace, settings)
    order = list(rep.decisions)
    S, L = trace.tokens_SLED.shape[:2]
    return CheckResult(checked=S * L * len(order), rows=S, layers=L, arrays=order, reshard_steps=rep.reshard_steps,
                       first=first_difference(compare(trace, rep), order),
                       pipeline_stage=_stage(trace.meta))


def _stage(meta: dict) -> tuple | None:
    if int(meta.get("pipeline_stages", 1)) <= 1:
        return None
    return int(meta["pipeline_stage"]), int(meta["pipeline_stages"]), list(meta.get("global_layers", []))

"""What one training forward of a layer decided: the record the runtime writes in its trace and
the report's replay derives from the trace's inputs (docs/traces.md). Pure (no DeepSpeed, no
process group): the replay runs without them.

Legend: E experts, D ranks.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ds_fssdp.planner.baselines import Clock, LayerPlan

__all__ = ["Decision", "decision_arrays", "plan_digest"]


@dataclass(frozen=True)
class Decision:
    """What one training forward of a layer decided (recorded in the trace, docs/traces.md)."""
    owner_E: torch.Tensor  # long [E]
    placed_ED: torch.Tensor  # bool [E, D]: pre-gating placement (gathered under the attention)
    held_ED: torch.Tensor  # bool [E, D]: the final placement (after post-gating)
    overlap_degree: int  # the clock's t
    latency_budget: float  # the clock's calibration budget (inf: none)
    window_s: float  # the clock's window that t is searched from (nan: none, t is the clock's)
    attention_s: float  # the clock's attention forward, the reduce's window (nan: none, twice window_s)
    overlap_t: int  # the t the pre-gating placement was planned with (-1: a policy without one)
    calibration_t: int  # calibration's t (-1: it did not run)
    calibration_accepted: bool
    plan_digest: int  # of the compact dispatch plan (equal plans, equal digests)
    rows_D: torch.Tensor  # long [D]: rows each rank computes
    traffic_DD: torch.Tensor  # long [D, D]: tokens rank d sends rank d2
    degrees: tuple = (-1, -1)  # (forward, backward) pipeline degrees (-1: not decided here, the replay)
    one_copy: int = -1  # one copy per destination taken (1) or not (0); -1: not decided here
    schedule_costs: tuple = (float("nan"), ) * 8  # the schedule's costs decided from (ScheduleCosts.as_row; nan: none)
    row_bytes: tuple = (-1, -1)  # (token row, gate weight) bytes the exchange decision priced (-1: not decided here)
    side_ratio: float = 0.0  # the work beside the exchange it priced, expert rows per token (moe/side.py)

    @classmethod
    def of(cls, owner_E, placed_ED, lp: LayerPlan, plan, clock: Clock, degrees: tuple = (-1, -1),
           one_copy: int = -1, *, overlap_t: int = -1, schedule_costs=None, row_bytes=(-1, -1),
           side_ratio: float = 0.0) -> "Decision":
        """From what a layer's planner returned (``lp.placement_ED``: the final placement,
        ``overlap_t``: the t of ``placed_ED``)."""
        cal = lp.calibration
        return cls(owner_E=owner_E.to("cpu", torch.long).clone(), placed_ED=placed_ED.to("cpu", torch.bool).clone(),
                   held_ED=lp.placement_ED.to("cpu", torch.bool).clone(),
                   overlap_degree=-1 if clock.overlap_degree is None else int(clock.overlap_degree),
                   latency_budget=float("nan") if clock.latency_budget is None else float(clock.latency_budget),
                   window_s=float("nan") if clock.window_s is None else float(clock.window_s),
                   attention_s=float("nan") if clock.attention_s is None else float(clock.attention_s),
                   overlap_t=int(overlap_t),
                   calibration_t=-1 if cal is None else int(cal.overlap_degree),
                   calibration_accepted=cal is not None and bool(cal.accepted), plan_digest=plan_digest(plan),
                   rows_D=plan.rows_D(), traffic_DD=plan.traffic_DD(), degrees=tuple(int(d) for d in degrees),
                   one_copy=int(one_copy),
                   schedule_costs=(float("nan"), ) * 8 if schedule_costs is None else tuple(schedule_costs.as_row()),
                   row_bytes=tuple(int(b) for b in row_bytes), side_ratio=float(side_ratio))


# the trace's decision_<key> arrays: (key, Decision field, dtype), in the trace's order
_ARRAYS = (("owner", "owner_E", np.int64), ("placed", "placed_ED", bool), ("held", "held_ED", bool),
           ("t", "overlap_degree", np.int64), ("latency_budget", "latency_budget", np.float64),
           ("window_s", "window_s", np.float64), ("attention_s", "attention_s", np.float64),
           ("overlap_t", "overlap_t", np.int64), ("calibration_t", "calibration_t", np.int64),
           ("calibration_accepted", "calibration_accepted", bool), ("plan_digest", "plan_digest", np.int64),
           ("rows", "rows_D", np.int64), ("traffic", "traffic_DD", np.int64), ("degrees", "degrees", np.int64),
           ("one_copy", "one_copy", np.int64), ("schedule_costs", "schedule_costs", np.float64),
           ("row_bytes", "row_bytes", np.int64), ("side_ratio", "side_ratio", np.float64))


def decision_arrays(decisions: list) -> dict:
    """One iteration's decisions of every layer as the trace's per-step arrays (docs/traces.md)."""
    return {f"decision_{key}": np.stack([np.asarray(getattr(d, field), dtype=dtype) for d in decisions])
            for key, field, dtype in _ARRAYS}


def plan_digest(plan) -> int:
    """A 63-bit digest of a compact :class:`~ds_fssdp.planner.plan.DispatchPlan` (its tokens, single
    holders, replicated experts and flows): two plans are the same plan iff (up to a hash
    collision) their digests are equal."""
    h = hashlib.blake2b(digest_size=8)
    for a in (plan.tokens_ED, plan.holder_E, plan.rep_X, plan.flows_4F):
        a = np.ascontiguousarray(a, dtype=np.int64)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return int.from_bytes(h.digest(), "little") >> 1

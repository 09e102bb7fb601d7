"""The placement every simulated FSSDP policy plans with (Algorithm 1 by default).

One name for both simulation engines (:mod:`.simulate`, :mod:`.cluster`), so that a new planner
entry for the placement replaces one line here.
"""
from ds_fssdp.planner.materialize import materialize as place  # noqa: F401

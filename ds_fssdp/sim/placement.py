"""The default materializer both simulation engines (:mod:`.simulate`, :mod:`.cluster`) hand their
FSSDP policies: Algorithm 1. A policy given it plans through the runtime's entry,
:func:`ds_fssdp.planner.place` (``FSSDPPolicy.pre_gating``), with the run's ``placement``
setting, so the simulator plans what the runtime gathers; another materializer injected here is
used instead for placement "paper".
"""
from ds_fssdp.planner.materialize import materialize as place  # noqa: F401

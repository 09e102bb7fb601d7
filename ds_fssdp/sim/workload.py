"""The trace a simulation replays: a recorded one fitted to the setup, or a synthetic one."""
from __future__ import annotations

import numpy as np

from ds_fssdp.sim.loadcv import LoadCVSource, load_cv
from ds_fssdp.sim.prediction import prediction_r2
from ds_fssdp.sim.remap import remap_trace
from ds_fssdp.sim.setup import Setup
from ds_fssdp.sim.synth import synthetic_trace
from ds_fssdp.sim.traces import load_trace, share_std

SYNTHETIC = "synthetic"
DEFAULT_LOAD_CV = 0.5  # the shared recorded trace's (/work/shared/data/trace_e8.npz: 0.49 over its last 200 steps)


def trace_for_setup(setup: Setup, source: str, *, top_k: int, steps: int | None = None, start: int = 0,
                    target_std: float = 0.04, seed: int = 0, split_concentration: float | None = None,
                    **synthetic_options) -> tuple:
    """(trace shaped [steps, L, E, D] for ``setup``, summary dict).

    ``source`` is a trace path or ``"synthetic"``. A recorded trace whose layers, experts or ranks
    differ from the setup is remapped (:func:`remap_trace`) to the setup's shape with the model's
    assignments per rank (tokens per GPU x top-k); steps ``[start, start + steps)`` are used."""
    L, E, D = setup.num_layers, setup.num_experts, setup.topology.num_ranks
    assignments = setup.tokens_per_gpu * top_k
    window = setup.load_window
    if source == SYNTHETIC:
        n = 200 if steps is None else steps
        trace = synthetic_trace(steps=n, num_layers=L, num_experts=E, num_ranks=D, assignments_per_rank=assignments,
                                target_std=target_std, top_k=top_k, seed=seed, **synthetic_options)
        desc = f"synthetic, target skew {target_std}, seed {seed}"
        return trace, _load_summary(trace.load_SLE(), window, description=desc, source=SYNTHETIC)
    recorded = load_trace(source)
    recorded = recorded.slice(start, steps)
    src_summary = {"steps": recorded.steps, "layers": recorded.num_layers, "experts": recorded.num_experts,
                   "ranks": recorded.num_ranks, "share_std": recorded.share_std(),
                   "r2": prediction_r2(recorded.load_SLE(), window) if recorded.steps > window else None}
    if (recorded.num_layers, recorded.num_experts, recorded.num_ranks) == (L, E, D):
        return recorded, _load_summary(recorded.load_SLE(), window, source=source, recorded=src_summary,
                                       description=f"{source} steps [{start}, {start + recorded.steps})")
    if E % recorded.num_experts:
        raise ValueError(f"trace {source!r} has {recorded.num_experts} experts; the setup's {E} must be a multiple "
                         f"of it to remap")
    trace = remap_trace(recorded, num_ranks=D, assignments_per_rank=assignments, num_experts=E, num_layers=L,
                        split_concentration=split_concentration, seed=seed)
    desc = (f"{source} steps [{start}, {start + recorded.steps}) remapped {recorded.num_layers}x{recorded.num_experts}"
            f"x{recorded.num_ranks} -> {L}x{E}x{D} (layers x experts x ranks)")
    return trace, _load_summary(trace.load_SLE(), window, description=desc, source=source, recorded=src_summary)


class RecordedLoads:
    """Iterates ``source`` (steps of ``tokens_LED``) and keeps each step's expert loads, for the
    summary of a trace that is generated as it is read."""

    def __init__(self, source, description: str):
        self.source, self.description, self.load_SLE = source, description, []

    def __iter__(self):
        for tokens_LED in self.source:
            self.load_SLE.append(np.asarray(tokens_LED).sum(2, dtype=np.int64))
            yield tokens_LED

    def summary(self, window: int) -> dict:
        return _load_summary(np.stack(self.load_SLE), window, description=self.description, source=SYNTHETIC)


def cv_workload(setup: Setup, *, top_k: int, steps: int | None, load_cv_target: float, seed: int = 0,
                **synthetic_options) -> RecordedLoads:
    """Synthetic steps at a CV of expert load (:class:`~ds_fssdp.sim.loadcv.LoadCVSource`),
    generated as the simulation reads them."""
    n = 200 if steps is None else steps
    source = LoadCVSource(steps=n, num_layers=setup.num_layers, num_experts=setup.num_experts,
                          num_ranks=setup.topology.num_ranks, assignments_per_rank=setup.tokens_per_gpu * top_k,
                          cv=load_cv_target, top_k=top_k, seed=seed, **synthetic_options)
    return RecordedLoads(source, f"synthetic, load CV {load_cv_target}, seed {seed}")


def _load_summary(load_SLE: np.ndarray, window: int, **extra) -> dict:
    return {"steps": load_SLE.shape[0], "share_std": share_std(load_SLE), "load_cv": load_cv(load_SLE),
            "r2": prediction_r2(load_SLE, window), "window": window, **extra}

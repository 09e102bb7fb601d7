"""Render a run directory's pictures and a short text summary (what ``python -m ds_fssdp.report`` does)."""
from __future__ import annotations

import glob
import os

import numpy as np

from ds_fssdp.report.figures import plot_load_heatmap, plot_metrics, plot_placement, read_metrics
from ds_fssdp.report.replay import ReplaySettings, replay
from ds_fssdp.sim.prediction import prediction_r2
from ds_fssdp.sim.traces import load_trace

TRACE_NAME = "trace.npz"
METRICS_NAME = "metrics.csv"


def find_trace(run: str) -> str:
    """``run`` itself if it is a trace file, else ``RUN/trace.npz``, else the only ``*.npz`` in it."""
    if os.path.isfile(run) or run.endswith(".npz"):
        return run
    if not os.path.isdir(run):
        raise FileNotFoundError(f"run directory {run!r} does not exist")
    preferred = os.path.join(run, TRACE_NAME)
    if os.path.exists(preferred):
        return preferred
    found = sorted(glob.glob(os.path.join(run, "*.npz")))
    if len(found) != 1:
        raise FileNotFoundError(f"{run!r} holds {len(found)} traces ({[os.path.basename(f) for f in found]}); "
                                f"name one with --trace (a run writes {TRACE_NAME} when fssdp.trace_path is set)")
    return found[0]


def find_metrics(run: str) -> str | None:
    """``RUN/metrics.csv`` or ``RUN/fssdp_metrics.csv`` if present."""
    directory = run if os.path.isdir(run) else os.path.dirname(os.path.abspath(run))
    for name in (METRICS_NAME, "fssdp_metrics.csv"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    return None


def render(run: str, *, out: str | None = None, trace_path: str | None = None, metrics_path: str | None = None,
           **replay_overrides) -> dict:
    """Write the PNGs for ``run`` into ``out`` (default: the run directory); return
    {"files": [...], "summary": [lines], "replay": Replay, "heatmap": ..., "placement": ...}."""
    trace_path = trace_path or find_trace(run)
    trace = load_trace(trace_path)
    out = out or (run if os.path.isdir(run) else os.path.dirname(os.path.abspath(trace_path)))
    os.makedirs(out, exist_ok=True)
    if trace.steps == 0:
        raise ValueError(f"trace {trace_path!r} has no iterations")
    settings = ReplaySettings.from_trace(trace, **replay_overrides)
    rep = replay(trace, settings)
    name = os.path.basename(os.path.dirname(os.path.abspath(trace_path))) if os.path.isdir(run) else \
        os.path.basename(trace_path)
    files = [os.path.join(out, "load_heatmap.png"), os.path.join(out, "placement.png")]
    heat = plot_load_heatmap(files[0], trace, title=f"{name}: expert share of each layer's tokens "
                             f"({trace.steps} iterations, {trace.num_experts} experts, {trace.num_ranks} ranks)")
    place = plot_placement(files[1], trace, rep)
    metrics_path = metrics_path or find_metrics(run)
    if metrics_path is not None:
        metrics = read_metrics(metrics_path)
        if len(metrics.get("step", [])):
            files.append(os.path.join(out, "metrics.png"))
            plot_metrics(files[-1], metrics, title=f"{name}: per-step metrics ({os.path.basename(metrics_path)})")
    return {"files": files, "summary": summary_lines(trace, rep, trace_path), "replay": rep, "heatmap": heat,
            "placement": place}


def summary_lines(trace, rep, trace_path: str) -> list:
    s = rep.settings
    lines = [f"trace {trace_path}: {trace.steps} iterations, {trace.num_layers} layers, {trace.num_experts} experts, "
             f"{trace.num_ranks} ranks; skew (std of expert share) {trace.share_std():.4f}"]
    if trace.steps > s.window:
        r2 = prediction_r2(trace.load_SLE(), window=s.window, per_layer=True)
        lines.append(f"load predictor (window {s.window}) R^2 per layer: " + ", ".join(f"{v:.3f}" for v in r2))
    strag, ep = rep.straggler_SL().mean(0), rep.ep_straggler_SL().mean(0)
    repl = rep.replicas_SL().mean(0)
    lines.append(f"replayed {s.policy} (m={s.budget}, t={s.overlap_degree}, ranks_per_node={s.ranks_per_node}): "
                 "per layer straggler EP -> placement: " +
                 ", ".join(f"{a:.2f}->{b:.2f}" for a, b in zip(ep, strag)) +
                 f"; replicas per iteration {np.round(repl, 2).tolist()}")
    lines += [f"note: {n}" for n in rep.notes]
    return lines

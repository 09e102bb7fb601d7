"""The report's PNGs: load heatmap, placement picture, per-step metrics.

Legend: S steps, L MoE layers, E experts, D ranks.

Each function draws one figure, saves it and returns what it drew (the arrays and, for the
heatmaps, each layer's axes box in image pixels, origin top-left), so tests can check that the
picture shows the data.
"""
from __future__ import annotations

import csv
import math

import matplotlib

matplotlib.use("Agg")  # files only; no display on training or CI machines
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from ds_fssdp.report.replay import Replay  # noqa: E402
from ds_fssdp.sim.traces import Trace  # noqa: E402

HEATMAP_CMAP = "viridis"
PLACEMENT_CMAP = "Blues"
OWNER_COLOR = "#d62728"
DPI = 100


def load_shares(trace: Trace) -> np.ndarray:
    """float64 [L, E, S]: each expert's share of its layer's assignments at every iteration."""
    load_SLE = trace.load_SLE().astype(np.float64)
    total_SL1 = load_SLE.sum(2, keepdims=True)
    share_SLE = np.divide(load_SLE, total_SL1, out=np.zeros_like(load_SLE), where=total_SL1 > 0)
    return share_SLE.transpose(1, 2, 0)


def plot_load_heatmap(path: str, trace: Trace, *, title: str = "") -> dict:
    """Expert share of tokens over iterations, one panel per layer (the paper's Figure 3)."""
    share_LES = load_shares(trace)
    L, E, S = share_LES.shape
    vmax = max(float(share_LES.max()), 1.0 / E) if share_LES.size else 1.0
    fig, axes = plt.subplots(L, 1, figsize=(10, 0.9 + max(1.2, 0.22 * E) * L), squeeze=False, sharex=True)
    image = None
    for l, ax in enumerate(axes[:, 0]):
        image = ax.imshow(share_LES[l], aspect="auto", interpolation="nearest", cmap=HEATMAP_CMAP, vmin=0.0,
                          vmax=vmax, origin="lower", extent=(-0.5, S - 0.5, -0.5, E - 0.5))
        std = float(share_LES[l].std(0).mean()) if S else 0.0
        ax.set_title(f"layer {l}: std of expert share {std:.3f} (uniform share {1 / E:.3f})", fontsize=9)
        ax.set_ylabel("expert")
        ax.set_yticks(range(E) if E <= 16 else np.linspace(0, E - 1, 9).round().astype(int))
    axes[-1, 0].set_xlabel("iteration")
    fig.suptitle(title or f"expert share of each layer's tokens ({S} iterations, {E} experts, "
                 f"{trace.num_ranks} ranks)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    cax = fig.add_axes((0.915, 0.1, 0.015, 0.8))
    fig.colorbar(image, cax=cax, label="share of the layer's assignments")
    boxes = _save(fig, path, axes[:, 0])
    return {"share_LES": share_LES, "vmin": 0.0, "vmax": vmax, "cmap": HEATMAP_CMAP, "axes_px": boxes}


def plot_placement(path: str, trace: Trace, rep: Replay, *, title: str = "") -> dict:
    """Per layer: who holds which expert (owners, and how often each rank held a replica), and
    the rows each rank computed with the replicas against static EP."""
    freq_LED = rep.replica_frequency_LED()
    L, E, D = freq_LED.shape
    fig, axes = plt.subplots(L, 2, figsize=(6 + 0.45 * D * 2, 0.8 + max(1.6, 0.3 * E) * L), squeeze=False,
                             gridspec_kw={"width_ratios": [max(D, 2), max(D, 2) + 2]})
    owner_ED = np.zeros((E, D), dtype=bool)
    owner_ED[np.arange(E), rep.owner_E] = True
    replicas_L = rep.replicas_SL().mean(0) if rep.held_SLED.size else np.zeros(L)
    annotate = E * D <= 160
    for l in range(L):
        ax = axes[l, 0]
        ax.imshow(freq_LED[l], aspect="auto", interpolation="nearest", cmap=PLACEMENT_CMAP, vmin=0.0, vmax=1.0,
                  origin="upper")
        ax.imshow(np.ma.masked_where(~owner_ED, np.ones((E, D))), aspect="auto", interpolation="nearest",
                  cmap=ListedColormap([OWNER_COLOR]), vmin=0.0, vmax=1.0, origin="upper")
        if annotate:
            for e in range(E):
                for d in range(D):
                    if owner_ED[e, d]:
                        ax.text(d, e, "owner", ha="center", va="center", fontsize=6, color="white")
                    elif freq_LED[l, e, d] > 0:
                        ax.text(d, e, f"{100 * freq_LED[l, e, d]:.0f}%", ha="center", va="center", fontsize=7,
                                color="white" if freq_LED[l, e, d] > 0.6 else "black")
        ax.set_xticks(range(D))
        ax.set_yticks(range(E) if E <= 16 else np.linspace(0, E - 1, 9).round().astype(int))
        ax.set_xlabel("rank")
        ax.set_ylabel("expert")
        ax.set_title(f"layer {l}: owners (red), replicas (% of iterations)\n{replicas_L[l]:.2f} replicas per "
                     "iteration", fontsize=8)
        ax = axes[l, 1]
        x = np.arange(D)
        ep = rep.ep_rows_SLD[:, l].mean(0) if rep.ep_rows_SLD.size else np.zeros(D)
        ours = rep.rows_SLD[:, l].mean(0) if rep.rows_SLD.size else np.zeros(D)
        ax.bar(x - 0.2, ep, width=0.4, color="#999999", label="owners only (EP)")
        ax.bar(x + 0.2, ours, width=0.4, color="#1f77b4", label=f"{rep.settings.policy} placement")
        s_ep = float(rep.ep_straggler_SL()[:, l].mean()) if rep.rows_SLD.size else 1.0
        s_ours = float(rep.straggler_SL()[:, l].mean()) if rep.rows_SLD.size else 1.0
        ax.set_xticks(x)
        ax.set_xlabel("rank")
        ax.set_ylabel("rows per iteration")
        ax.set_title(f"rows computed per rank (mean); straggler EP {s_ep:.2f} -> {s_ours:.2f}", fontsize=8)
        ax.set_ylim(0, 1.3 * max(float(ep.max(initial=0)), float(ours.max(initial=0)), 1.0))
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    s = rep.settings
    nodes = D // int(s.ranks_per_node or D)
    head = title or (f"placement ({s.policy}, m={s.budget}, t={s.overlap_degree}, window {s.window}, {D} ranks in "
                     f"{nodes} node{'s' if nodes > 1 else ''}; replayed from the trace's loads)")
    if rep.notes:
        head += "\n" + "; ".join(rep.notes)
    fig.suptitle(head, fontsize=9)
    fig.tight_layout()
    boxes = _save(fig, path, axes[:, 0])
    return {"replica_frequency_LED": freq_LED, "owner_E": rep.owner_E, "replicas_L": replicas_L,
            "cmap": PLACEMENT_CMAP, "owner_color": OWNER_COLOR, "axes_px": boxes}


def read_metrics(path: str) -> dict:
    """The runtime's metrics CSV (``fssdp.metrics_csv``) as {column: float64 array}."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        rows = [r for r in reader if r]
    if header is None:
        raise ValueError(f"metrics CSV {path!r} is empty (no header)")
    data = np.array([[float(v) if v else math.nan for v in r] for r in rows], dtype=np.float64).reshape(-1, len(header))
    return {name: data[:, i] for i, name in enumerate(header)}


def plot_metrics(path: str, metrics: dict, *, title: str = "") -> dict:
    """Straggler factor (and what EP would have had), bytes moved and load-prediction error per
    layer over optimizer steps."""
    layers = sorted({int(k.split("/")[0][5:]) for k in metrics if k.startswith("layer") and "/" in k})
    step = metrics["step"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for l in layers:
        c = colors[l % len(colors)]
        axes[0].plot(step, metrics[f"layer{l}/straggler"], color=c, lw=1, label=f"layer {l}")
        axes[0].plot(step, metrics[f"layer{l}/ep_straggler"], color=c, lw=0.8, ls=":")
        moved = np.nan_to_num(metrics[f"layer{l}/gather_bytes"]) + np.nan_to_num(metrics[f"layer{l}/reduce_bytes"])
        axes[1].plot(step, np.cumsum(moved) / 2**20, color=c, lw=1, label=f"layer {l}")
        axes[2].plot(step, metrics[f"layer{l}/load_prediction_error"], color=c, lw=1, label=f"layer {l}")
    axes[0].set_title("straggler factor (max/mean rows per rank); dotted: EP", fontsize=9)
    axes[1].set_title("replica bytes gathered + reduced, cumulative (MiB)", fontsize=9)
    axes[2].set_title("load-prediction error (sum |pred - actual| / sum actual)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path, [])
    return {"layers": layers}


def _save(fig, path: str, axes) -> list:
    """Save at DPI; return each axis' box (x0, y0, x1, y1) in the PNG's pixels, origin top-left."""
    fig.canvas.draw()
    height = fig.get_size_inches()[1] * DPI
    scale = DPI / fig.dpi
    boxes = []
    for ax in axes:
        b = ax.get_window_extent()
        boxes.append((b.x0 * scale, height - b.y1 * scale, b.x1 * scale, height - b.y0 * scale))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return boxes

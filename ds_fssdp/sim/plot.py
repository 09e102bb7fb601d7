"""PNG bar chart of a simulation: time breakdown per iteration (Figure 11 style, speedup over EP on
top of each bar) and model-state memory of the fullest rank (Figure 12 style)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; no display on training or CI machines
import matplotlib.pyplot as plt  # noqa: E402

from ds_fssdp.sim.report import CATEGORIES, ratios  # noqa: E402

_LABELS = {"comp": "Comp", "a2a": "A2A", "spag": "SpAG/SpRS", "rearr": "Rearr", "ar": "AR", "opt": "Opt"}


def plot_results(path: str, results: list, *, title: str) -> None:
    names = [r.policy for r in results]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(names) + 4), 4.5))
    top = _stacked(ax_t, names, [(_LABELS[c], [1e3 * r.breakdown_s[c] for r in results]) for c in CATEGORIES],
                   ylabel="ms per iteration (critical path)", title="time (speedup over EP)")
    speedup = ratios(results)["speedup_vs_ep"]
    for i, r in enumerate(results):
        if r.policy in speedup:
            ax_t.text(i, top[i], f"{speedup[r.policy]:.2f}x", ha="center", va="bottom", fontsize=8)
    _stacked(ax_m, names, [(label, [r.memory_bytes[key] / 1e9 for r in results])
                           for key, label in (("param", "Param"), ("grad", "Grad"), ("opt", "Opt"))],
             ylabel="GB (fullest rank, activations excluded)", title="model-state memory")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _stacked(ax, names: list, series: list, *, ylabel: str, title: str) -> list:
    """Bars of ``series`` ((label, one value per name) each) stacked per name; returns their tops."""
    bottom = [0.0] * len(names)
    for label, values in series:
        ax.bar(range(len(names)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(list(range(len(names))), names, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return bottom

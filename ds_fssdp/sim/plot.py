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
    x = range(len(names))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(names) + 4), 4.5))
    bottom = [0.0] * len(names)
    for cat in CATEGORIES:
        values = [1e3 * r.breakdown_s[cat] for r in results]
        ax_t.bar(x, values, bottom=bottom, label=_LABELS[cat])
        bottom = [b + v for b, v in zip(bottom, values)]
    speedup = ratios(results)["speedup_vs_ep"]
    for i, r in enumerate(results):
        if r.policy in speedup:
            ax_t.text(i, bottom[i], f"{speedup[r.policy]:.2f}x", ha="center", va="bottom", fontsize=8)
    ax_t.set_xticks(list(x), names, rotation=30, ha="right")
    ax_t.set_ylabel("ms per iteration (critical path)")
    ax_t.set_title("time (speedup over EP)")
    ax_t.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    bottom = [0.0] * len(names)
    for key, label in (("param", "Param"), ("grad", "Grad"), ("opt", "Opt")):
        values = [r.memory_bytes[key] / 1e9 for r in results]
        ax_m.bar(x, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_m.set_xticks(list(x), names, rotation=30, ha="right")
    ax_m.set_ylabel("GB (fullest rank, activations excluded)")
    ax_m.set_title("model-state memory")
    ax_m.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""The simulator's results (:class:`PolicyResult`; :class:`ClusterResult` with the cluster
engine's extras), its table (Figure 9's speedups, Figure 11's breakdown, Figure 12's memory) and JSON."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

CATEGORIES = ("comp", "a2a", "spag", "rearr", "ar", "opt")


@dataclass
class PolicyResult:
    policy: str
    iteration_s: float
    breakdown_s: dict  # CATEGORIES -> mean seconds per iteration
    memory_bytes: dict  # param, grad, opt at the peak rank and iteration
    straggler: float  # mean over layers and steps of max / mean rows per rank
    inter_node_gb: float  # token bytes crossing nodes per iteration (4 exchanges, all layers)
    replicas_per_layer: float  # mean pairs beyond the shard (ephemeral + persistent)
    migrated_experts: int  # expert states copied by reshards over the whole run
    budget: int
    step_s: list = field(default_factory=list)
    lower_bound_s: float | None = None  # the workload's (ds_fssdp.sim.bound), alike for every policy
    degrees: dict = field(default_factory=dict)  # "forward"/"backward" -> {degree: timed layers (x groups)}
    dedup_saved_gb: float = 0.0  # link bytes one copy per destination saved per iteration (< 0: relays moved more)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy, "iteration_ms": 1e3 * self.iteration_s,
            "breakdown_ms": {k: 1e3 * v for k, v in self.breakdown_s.items()},
            "memory_gb": {k: v / 1e9 for k, v in self.memory_bytes.items()}, "straggler": self.straggler,
            "inter_node_gb": self.inter_node_gb, "replicas_per_layer": self.replicas_per_layer,
            "migrated_experts": self.migrated_experts, "budget": self.budget,
            "lower_bound_ms": None if self.lower_bound_s is None else 1e3 * self.lower_bound_s,
            "vs_lower_bound": None if self.lower_bound_s is None else self.iteration_s / self.lower_bound_s,
            "degrees": self.degrees, "dedup_saved_gb": self.dedup_saved_gb,
        }

    def paper(self) -> "PolicyResult":
        """These numbers without a subclass's extras (the paper's report)."""
        return PolicyResult(**{f.name: getattr(self, f.name) for f in fields(PolicyResult)})


@dataclass
class ClusterResult(PolicyResult):
    group_size: int = 0
    count_allgather_s: float = 0.0
    planning_s: dict = field(default_factory=dict)  # pre_gating, post_gating: seconds per iteration, one rank
    link_bytes: dict = field(default_factory=dict)  # category -> {gpu_mean, gpu_max, node_mean, node_max}
    ep_memory_bytes: float = 0.0  # EP's fullest rank at this group size
    memory_cap: float | None = None
    overlap_degree: int = 0
    groups: int = 1
    groups_simulated: int = 1
    split_steps: float = 0.0  # share of the timed steps whose experts' all-gather ran in the next forward (sim/sync.py)

    @property
    def total_s(self) -> float:
        """Iteration with the count all-gather and the planning after gating (critical path)."""
        return self.iteration_s + self.count_allgather_s + self.planning_s.get("post_gating", 0.0)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.update(iteration_s=self.iteration_s, memory_bytes=self.memory_bytes, group_size=self.group_size,
                   count_allgather_ms=1e3 * self.count_allgather_s,
                   planning_ms={k: 1e3 * v for k, v in self.planning_s.items()}, total_ms=1e3 * self.total_s,
                   link_bytes=self.link_bytes, memory_vs_ep=sum(self.memory_bytes.values()) / self.ep_memory_bytes,
                   memory_cap=self.memory_cap, overlap_degree=self.overlap_degree, groups=self.groups,
                   groups_simulated=self.groups_simulated, split_steps=self.split_steps)
        return out


def ratios(results: list) -> dict:
    """Speedups the paper reports: each policy over EP and over FasterMoE (time ratio > 1 means
    faster), and how much slower EP is than Uniform."""
    by = {r.policy: r.iteration_s for r in results}
    out = {"speedup_vs_ep": {}, "speedup_vs_fastermoe": {}, "ep_slowdown_vs_uniform": None}
    for name, t in by.items():
        if "ep" in by:
            out["speedup_vs_ep"][name] = by["ep"] / t
        if "fastermoe" in by:
            out["speedup_vs_fastermoe"][name] = by["fastermoe"] / t
    if "ep" in by and "uniform" in by:
        out["ep_slowdown_vs_uniform"] = by["ep"] / by["uniform"]
    return out


def lower_bound(results: list):
    """The workload's lower bound (seconds; every result carries the same), or None."""
    return next((r.lower_bound_s for r in results if getattr(r, "lower_bound_s", None) is not None), None)


def to_json(setup_summary: dict, trace_summary: dict, results: list) -> dict:
    low = lower_bound(results)
    return {"setup": setup_summary, "trace": trace_summary, "results": [r.to_dict() for r in results],
            "lower_bound_ms": None if low is None else 1e3 * low,
            "vs_lower_bound": {} if low is None else {r.policy: r.iteration_s / low for r in results},
            **ratios(results)}


def format_table(setup_summary: dict, trace_summary: dict, results: list) -> str:
    s, t = setup_summary, trace_summary
    hw = s["hardware"]
    cv = f", load CV {t['load_cv']:.3f}" if "load_cv" in t else ""
    lines = [
        f"{s['label']}: E={s['num_experts']} experts x {s['num_layers']} layers, {s['tokens_per_gpu']} tokens/GPU, "
        f"expert {s['expert_bytes'] / 1e6:.1f} MB, attention fwd {s['attention_fwd_ms']:.2f} ms",
        f"  hardware: {hw['flops'] / 1e12:.0f} TFLOP/s, intra {hw['intra_bw'] / 1e9:.0f} GB/s/GPU, inter "
        f"{hw['inter_bw'] / 1e9:.0f} GB/s/node; knobs: t={s['overlap_degree']}, m={s['budget']} (rm {s['budget_rm']}), "
        f"flexmoe slots={s['flexmoe_slots']}, reshard every {s['reshard_interval']}, smartmoe every "
        f"{s['smartmoe_interval']}, calibration {'on' if s['calibration'] else 'off'}, dispatch "
        f"{s.get('dispatch', 'paper')}, ZeRO {s.get('zero_stage', 0)}",
        f"  trace: {t.get('description', '')}; {t['steps']} steps, skew (std of expert share) {t['share_std']:.4f}"
        f"{cv}, predictor R^2 (w={t['window']}) {t['r2']:.3f}",
    ]
    r = ratios(results)
    low = lower_bound(results)
    header = (f"{'policy':<10} {'ms/iter':>9} {'xEP':>6} {'xFMoE':>6} {'/LB':>5} |" +
              "".join(f" {c:>7}" for c in CATEGORIES) + f" | {'strag':>5} {'repl/L':>7} | {'mem GB':>6}"
              f" {'(P/G/O)':>16}")
    lines += ["", header, "-" * len(header)]
    for res in results:
        mem = res.memory_bytes
        total = sum(mem.values()) / 1e9
        vs_ep = r["speedup_vs_ep"].get(res.policy)
        vs_f = r["speedup_vs_fastermoe"].get(res.policy)
        vs_lb = None if low is None else res.iteration_s / low
        lines.append(f"{res.policy:<10} {1e3 * res.iteration_s:>9.1f} {_x(vs_ep):>6} {_x(vs_f):>6} {_x(vs_lb):>5} |" +
                     "".join(f" {1e3 * res.breakdown_s[c]:>7.1f}" for c in CATEGORIES) +
                     f" | {res.straggler:>5.2f} {res.replicas_per_layer:>7.1f} | {total:>6.2f} "
                     f"{mem['param'] / 1e9:>5.2f}/{mem['grad'] / 1e9:.2f}/{mem['opt'] / 1e9:.2f}")
    if low is not None:
        lines += ["", f"lower bound {1e3 * low:.1f} ms per iteration (ds_fssdp.sim.bound: balanced compute or the "
                  f"rows that must cross, attention, optimizer; /LB = each policy's ratio to it)"]
    if r["ep_slowdown_vs_uniform"] is not None:
        lines += ["", f"EP is {r['ep_slowdown_vs_uniform']:.2f}x slower than Uniform (paper: 1.48-2.87x)."]
    for ours in ("fssdp", "fssdp-rm"):
        if ours in r["speedup_vs_fastermoe"] and "ep" in r["speedup_vs_ep"]:
            lines.append(f"{ours}: {r['speedup_vs_ep'][ours]:.2f}x over EP (paper: up to 3.68x), "
                         f"{r['speedup_vs_fastermoe'][ours]:.2f}x over FasterMoE (paper: 1.26-2.37x).")
    lines.append("Breakdown columns are ms per iteration on the critical path (exposed time only); strag = max/mean "
                 "rows per rank; repl/L = replica pairs beyond the shard per layer; mem = model states of the fullest "
                 "rank (activations excluded).")
    if results and hasattr(results[0], "group_size"):
        lines += ["", cluster_table(results)]
    return "\n".join(lines)


def cluster_table(results: list) -> str:
    """The cluster-scale columns: group size, m, memory over EP's, count all-gather and
    measured planning per iteration, and the busiest links' bytes per iteration."""
    header = (f"{'policy':<10} {'group':>6} {'t':>3} {'m':>4} {'mem/EP':>7} | {'count ms':>8} {'plan ms':>8} "
              f"{'(pre/post)':>14} {'total ms':>9} | {'GPU link GB':>11} {'node link GB':>12}")
    lines = [header, "-" * len(header)]
    for r in results:
        gpu, node = (sum(v[k] for v in r.link_bytes.values()) / 1e9 for k in ("gpu_max", "node_max"))
        pre, post = (1e3 * r.planning_s.get(k, 0.0) for k in ("pre_gating", "post_gating"))
        mem = sum(r.memory_bytes.values()) / r.ep_memory_bytes
        lines.append(f"{r.policy:<10} {r.group_size:>6} {r.overlap_degree:>3} {r.budget:>4} {mem:>7.3f} | "
                     f"{1e3 * r.count_allgather_s:>8.2f} "
                     f"{pre + post:>8.2f} {f'{pre:.1f}/{post:.1f}':>14} {1e3 * r.total_s:>9.1f} | {gpu:>11.2f} {node:>12.2f}")
    lines.append("count = the tokens_ED all-gather of every layer; plan = measured planning on one rank (pre: "
                 "placement before gating, post: calibration + dispatch, on the critical path); total = iteration + "
                 "count + post; links: the busiest GPU / node link's bytes per iteration (summed over categories' "
                 "busiest).")
    return "\n".join(lines)


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def result_from_dict(d: dict) -> PolicyResult:
    """Inverse of :meth:`PolicyResult.to_dict` (for re-plotting saved JSON)."""
    return PolicyResult(policy=d["policy"], iteration_s=d["iteration_ms"] / 1e3,
                        breakdown_s={k: v / 1e3 for k, v in d["breakdown_ms"].items()},
                        memory_bytes={k: v * 1e9 for k, v in d["memory_gb"].items()}, straggler=d["straggler"],
                        inter_node_gb=d["inter_node_gb"], replicas_per_layer=d["replicas_per_layer"],
                        migrated_experts=d["migrated_experts"], budget=d["budget"])

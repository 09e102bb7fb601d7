"""Replay routing traces through the planner: straggler factor and inter-node traffic of EP, the
paper's dispatch (Algorithm 3) and the balancing dispatch, against the best the placement allows.

    python benchmarks/dispatch.py [--trace ../shared/data/trace_e8.npz] [--ranks-per-node 4]
                                  [--budget 2] [--overlap-degree 8] [--window 5] [--json out.json]

Per step and layer: loads predicted from the previous ``window`` steps, the placement from
Algorithm 1 (``materialize``), then each dispatcher on the actual tokens. ``bound`` is the exact
lower bound on the most loaded rank's rows for that placement (fractional, all expert subsets).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import LoadPredictor, dispatch, homogeneous_owner, materialize, shard_placement
from ds_fssdp.planner.balance import balanced_dispatch, row_bound

HERE = os.path.dirname(os.path.abspath(__file__))


def load_trace(path):
    with np.load(path) as f:
        return torch.from_numpy(f["tokens"].astype(np.int64))  # [steps, L, E, D]


def inter_node_fraction(plan_EDD, topo):
    same = topo.same_node_DD()
    moved = plan_EDD.sum(0).double()
    total = float(moved.sum())
    return float(moved[~same].sum()) / total if total else 0.0


def straggler(plan_EDD):
    rows = plan_EDD.sum((0, 1)).double()
    return float(rows.max() / rows.mean())


def replay(tokens, *, ranks_per_node, budget, overlap_degree, window):
    steps, L, E, D = tokens.shape
    topo = Topology(num_ranks=D, ranks_per_node=ranks_per_node)
    owner = homogeneous_owner(E, D)
    shard = shard_placement(owner, D)
    pred = LoadPredictor([E] * L, window=window)
    out = {k: [] for k in ("ep", "paper", "balanced", "bound")}
    inter = {k: [] for k in ("ep", "paper", "balanced")}
    times = {"materialize": [], "paper": [], "balanced": []}
    for s in range(steps):
        for l in range(L):
            t_ED = tokens[s, l]
            load = pred.predict(l)
            if load is not None:
                t0 = time.perf_counter()
                p = materialize(owner, load, topo, overlap_degree=overlap_degree, budget=budget)
                times["materialize"].append(time.perf_counter() - t0)
                plans = {"ep": dispatch(shard, t_ED, topo)}
                t0 = time.perf_counter()
                plans["paper"] = dispatch(p, t_ED, topo)
                times["paper"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                plans["balanced"] = balanced_dispatch(p, t_ED, topo)
                times["balanced"].append(time.perf_counter() - t0)
                for k, plan in plans.items():
                    out[k].append(straggler(plan))
                    inter[k].append(inter_node_fraction(plan, topo))
                rows_mean = float(t_ED.sum()) / D
                P = p.numpy()
                hold = P.sum(1)
                base = np.zeros(D)
                single = np.nonzero(hold == 1)[0]
                np.add.at(base, P[single].argmax(1), t_ED.numpy()[single].sum(1))
                rep = np.nonzero(hold > 1)[0]
                out["bound"].append(row_bound(P[rep], t_ED.numpy()[rep].sum(1), base) / rows_mean)
            pred.observe(l, t_ED.sum(1))
    summary = {k: statistics.fmean(v) for k, v in out.items()}
    summary.update({f"inter_node_{k}": statistics.fmean(v) for k, v in inter.items()})
    summary.update({f"median_us_{k}": statistics.median(v) * 1e6 for k, v in times.items()})
    summary["samples"] = len(out["ep"])
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", action="append", default=None)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--budget", type=int, default=2)
    p.add_argument("--overlap-degree", type=int, default=8)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    traces = args.trace or [os.path.join(HERE, "..", "..", "shared", "data", "trace_e8.npz")]
    results = {"machine": platform.processor() or platform.machine(), "args": vars(args), "traces": {}}
    for path in traces:
        tokens = load_trace(path)
        r = replay(tokens, ranks_per_node=args.ranks_per_node, budget=args.budget,
                   overlap_degree=args.overlap_degree, window=args.window)
        results["traces"][os.path.basename(path)] = r
        print(f"{os.path.basename(path)} {tuple(tokens.shape)}: straggler EP {r['ep']:.3f}  paper {r['paper']:.3f}  "
              f"balanced {r['balanced']:.3f}  bound {r['bound']:.3f} | inter-node tokens EP {r['inter_node_ep']:.3f} "
              f"paper {r['inter_node_paper']:.3f} balanced {r['inter_node_balanced']:.3f} | median us: materialize "
              f"{r['median_us_materialize']:.0f} paper {r['median_us_paper']:.0f} balanced "
              f"{r['median_us_balanced']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

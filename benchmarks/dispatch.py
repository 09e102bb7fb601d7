"""Replay routing traces through the planner: straggler factor, inter-node traffic and modelled
time of EP, the paper's planner (Algorithm 1 + Algorithm 3), the balancing dispatcher on
Algorithm 1's placements, and ours (joint placement + balancing dispatch), against the best each
placement allows. ``joint+balanced-3%`` is the runtime's default (``dispatch_slack`` 0.03: the
busiest rank may compute 3% more rows than the best, so fewer tokens cross nodes).

    python benchmarks/dispatch.py [--trace ../shared/data/trace_e8.npz ...] [--ranks-per-node 4]
                                  [--budget 2] [--overlap-degree 8] [--window 5] [--json out.json]

Per step and layer: loads (and, for joint placement, tokens_ED) predicted from the previous
``window`` steps, a placement, then each dispatcher on the actual tokens. ``bound``: the exact
lower bound on the most loaded rank's rows for that placement (fractional, all replicated-expert
subsets). Modelled time: ``planner.CostModel`` with cluster A's hardware (A100, 300 GB/s per GPU
in a node, 50 GB/s per node between nodes) and GPT-S-MoE experts (768 x 3072), the trace's rows
as tokens: the slowest rank's expert compute plus four token exchanges. Traces recorded by the
main job (``fssdp.trace_path``) work too.
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
from ds_fssdp.planner import (CostModel, ExpertShape, Hardware, dispatch, homogeneous_owner, materialize,
                              shard_placement)
from ds_fssdp.planner.balance import row_bound
from ds_fssdp.planner.joint import joint_materialize
from ds_fssdp.sim.traces import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = ("ep", "paper", "alg1+balanced", "joint+balanced", "joint+balanced-3%")


def bound(P: np.ndarray, T: np.ndarray) -> float:
    hold = P.sum(1)
    single = np.nonzero(hold == 1)[0]
    base = np.zeros(P.shape[1])
    np.add.at(base, P[single].argmax(1), T[single].sum(1))
    rep = np.nonzero(hold > 1)[0]
    return row_bound(P[rep], T[rep].sum(1), base)


def replay(tokens_SLED: torch.Tensor, *, ranks_per_node, budget, overlap_degree, window):
    steps, L, E, D = tokens_SLED.shape
    topo = Topology(num_ranks=D, ranks_per_node=ranks_per_node)
    cost = CostModel(Hardware(flops=150e12, intra_bw=300e9, inter_bw=50e9), ExpertShape(hidden=768, ffn=3072), topo)
    owner = homogeneous_owner(E, D)
    shard = shard_placement(owner, D)
    same = topo.same_node_DD()
    hist = [[] for _ in range(L)]
    out = {arm: {"straggler": [], "inter": [], "time": [], "bound": []} for arm in ARMS}
    plan_us = {"paper": [], "joint+balanced": []}
    for s in range(steps):
        for l in range(L):
            T = tokens_SLED[s, l]
            if hist[l]:
                pred = torch.stack(hist[l][-window:]).double().mean(0)
                t0 = time.perf_counter()
                p1 = materialize(owner, pred.sum(1), topo, overlap_degree=overlap_degree, budget=budget)
                paper = dispatch(p1, T, topo, mode="paper")
                t1 = time.perf_counter()
                pj = joint_materialize(owner, pred, topo, overlap_degree=overlap_degree, budget=budget)
                ours = dispatch(pj, T, topo, mode="balanced")
                t2 = time.perf_counter()
                plan_us["paper"].append((t1 - t0) * 1e6)
                plan_us["joint+balanced"].append((t2 - t1) * 1e6)
                plans = {"ep": (shard, dispatch(shard, T, topo)), "paper": (p1, paper),
                         "alg1+balanced": (p1, dispatch(p1, T, topo, mode="balanced")), "joint+balanced": (pj, ours),
                         "joint+balanced-3%": (pj, dispatch(pj, T, topo, mode="balanced", slack=0.03))}
                mean_rows = float(T.sum()) / D
                ep_time = cost.layer_time(plans["ep"][1])
                for arm, (p, plan) in plans.items():
                    rows = plan.sum((0, 1)).double()
                    out[arm]["straggler"].append(float(rows.max()) / mean_rows)
                    out[arm]["inter"].append(float(plan.sum(0)[~same].sum()) / float(T.sum()))
                    out[arm]["time"].append(cost.layer_time(plan) / ep_time)
                    out[arm]["bound"].append(bound(p.numpy(), T.numpy()) / mean_rows)
            hist[l].append(T)
    summary = {arm: {k: statistics.fmean(v) for k, v in d.items()} for arm, d in out.items()}
    summary["plan_us_median"] = {k: statistics.median(v) for k, v in plan_us.items()}
    summary["samples"] = len(out["ep"]["straggler"])
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
    results = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "args": vars(args), "traces": {}}
    for path in traces:
        tokens = torch.from_numpy(load_trace(path).tokens_SLED.astype(np.int64))
        rpn = args.ranks_per_node if tokens.shape[3] % args.ranks_per_node == 0 else tokens.shape[3]
        r = replay(tokens, ranks_per_node=rpn, budget=args.budget, overlap_degree=args.overlap_degree,
                   window=args.window)
        results["traces"][os.path.basename(path)] = r
        print(f"\n{os.path.basename(path)} {tuple(tokens.shape)} (steps, layers, experts, ranks), {rpn} ranks per node")
        print(f"{'arm':>15} {'straggler':>9} {'bound':>6} {'inter-node':>10} {'time/EP':>8}")
        for arm in ARMS:
            a = r[arm]
            print(f"{arm:>15} {a['straggler']:>9.3f} {a['bound']:>6.3f} {a['inter']:>10.4f} {a['time']:>8.3f}")
        print(f"median planning time per layer in this replay (dense [E, D, D] plans and the load sum "
              f"included; the runtime's compact path is timed by benchmarks/planning.py): "
              + ", ".join(f"{k} {v:.0f} us" for k, v in r["plan_us_median"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""Replay routing traces through the planner: straggler factor, inter-node traffic and modelled
time of EP, the paper's planner (Algorithm 1 + Algorithm 3), the balancing dispatcher on
Algorithm 1's placements, and ours (joint placement + balancing dispatch), against the best each
placement allows. ``joint+balanced-3%`` is joint placement with the default dispatch (``dispatch_slack`` 0.03: the
busiest rank may compute 3% more rows than the best, so fewer tokens cross nodes);
(The cost-aware placement's arms left with ``placement: "cost"``; what they measured is in
results/dispatch_cost*.json and results/README.md.)

    python benchmarks/dispatch.py [--trace ../shared/data/trace_e8.npz ...] [--ranks-per-node 4]
                                  [--budget 2] [--overlap-degree 8] [--window 5] [--json out.json]
                                  [--rows-per-rank N] [--synthetic zipf,heavy]

``--rows-per-rank N`` scales every trace so a rank routes N rows per layer (the recorded trace has
1024; a 4k-token micro-batch with top-2 has 8192). ``--synthetic``: traces drawn here (64 experts,
32 ranks in 4 nodes, 8192 rows per rank, 200 steps, seed 0): ``zipf`` (expert popularity ~ 1 / rank,
reshuffled slowly) and ``heavy`` (two experts take a third of the tokens).
Per arm: replicas and replica bytes per layer (gathered; the reduce moves as many again), and
the modelled time relative to EP: without the replicas' gather and reduce (``time/EP``: the overlap
window hides all of it), with what the window leaves exposed (``+window``: the forward attention
hides ``CostModel.overlap_window(t)`` of the gather, the backward twice that of the reduce), and with
all of it on the critical path (``+transfer``).

Per step and layer: loads (and, for joint placement, tokens_ED) predicted from the previous
``window`` steps (``LoadPredictor``), a placement, then each dispatcher on the actual tokens. ``bound``: the exact
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
from ds_fssdp.planner import (CostModel, ExpertShape, Hardware, LoadPredictor, dispatch, homogeneous_owner,
                              materialize, shard_placement)
from ds_fssdp.planner.balance import row_bound
from ds_fssdp.planner.cost import exposed_transfer
from ds_fssdp.planner.joint import joint_materialize
from ds_fssdp.sim.traces import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))

ARMS = ("ep", "paper", "alg1+balanced", "joint+balanced", "joint+balanced-3%")
METRICS = ("straggler", "inter", "time", "time_window", "time_transfer", "bound", "replicas", "replica_mb")


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
    window_s = cost.overlap_window(overlap_degree)  # hides the gather; twice it, in the backward, the reduce
    predictor = LoadPredictor([E] * L, window=window)
    out = {arm: {k: [] for k in METRICS} for arm in ARMS}
    plan_us = {"paper": [], "joint+balanced": []}
    for s in range(steps):
        for l in range(L):
            T = tokens_SLED[s, l]
            pred = predictor.predict_tokens(l)
            if pred is not None:
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
                    replicas = int((p & ~shard).sum())
                    o = out[arm]
                    o["straggler"].append(float(rows.max()) / mean_rows)
                    o["inter"].append(float(plan.sum(0)[~same].sum()) / float(T.sum()))
                    layer = cost.layer_time(plan)
                    o["time"].append(layer / ep_time)
                    gather = cost.sparse_collective_time(owner, p) if replicas else 0.0
                    o["time_transfer"].append((layer + 2.0 * gather) / ep_time)  # gather + reduce
                    o["time_window"].append((layer + exposed_transfer(gather, window_s)) / ep_time)
                    o["bound"].append(bound(p.numpy(), T.numpy()) / mean_rows)
                    o["replicas"].append(replicas)
                    o["replica_mb"].append(replicas * cost.shape.expert_bytes / 1e6)
            predictor.observe(l, T)
    summary = {arm: {k: statistics.fmean(v) for k, v in d.items()} for arm, d in out.items()}
    summary["plan_us_median"] = {k: statistics.median(v) for k, v in plan_us.items()}
    summary["samples"] = len(out["ep"]["straggler"])
    summary["expert_mb"] = cost.shape.expert_bytes / 1e6
    return summary


def synthetic(kind: str, *, steps=200, experts=64, ranks=32, rows=8192, seed=0) -> torch.Tensor:
    """[steps, 1, experts, ranks] counts: ``zipf`` (popularity ~ 1 / rank, two experts swap places
    every 20 steps) or ``heavy`` (two experts share a third of the tokens, the rest uniform)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "zipf":
        base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    elif kind == "heavy":
        base = torch.full((experts, ), 2.0 / (3.0 * (experts - 2)), dtype=torch.float64)
        base[:2] = 1.0 / 6.0
    else:
        raise ValueError(f"--synthetic {kind!r} must be zipf or heavy")
    perm = torch.randperm(experts, generator=gen)
    out = torch.zeros(steps, 1, experts, ranks, dtype=torch.long)
    for s in range(steps):
        if s and s % 20 == 0:
            i, j = torch.randint(0, experts, (2, ), generator=gen).tolist()
            perm[[i, j]] = perm[[j, i]]
        noise = torch.exp(0.1 * torch.randn(ranks, experts, generator=gen, dtype=torch.float64))
        probs = base[perm][None, :] * noise
        for d in range(ranks):
            out[s, 0, :, d] = torch.multinomial(probs[d] / probs[d].sum(), rows, replacement=True,
                                                generator=gen).bincount(minlength=experts)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", action="append", default=None)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--budget", type=int, default=2)
    p.add_argument("--overlap-degree", type=int, default=8)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--rows-per-rank", type=int, action="append", default=None,
                   help="scale each trace to this many rows per rank and layer (repeatable; default: as recorded)")
    p.add_argument("--synthetic", default="", help="comma-separated: zipf, heavy")
    args = p.parse_args()
    torch.set_num_threads(1)
    paths = args.trace or [os.path.join(HERE, "..", "..", "shared", "data", "trace_e8.npz")]
    inputs = []
    for path in paths:
        raw = torch.from_numpy(load_trace(path).tokens_SLED.astype(np.int64))
        rpn = args.ranks_per_node if raw.shape[3] % args.ranks_per_node == 0 else raw.shape[3]
        per_rank = float(raw.sum()) / (raw.shape[0] * raw.shape[1] * raw.shape[3])
        for rows in args.rows_per_rank or [None]:
            tokens = raw if rows is None else torch.round(raw.double() * (rows / per_rank)).long()
            name = os.path.basename(path) + ("" if rows is None else f"@{rows}rows")
            inputs.append((name, tokens, rpn))
    for kind in filter(None, args.synthetic.split(",")):
        inputs.append((f"synthetic-{kind}", synthetic(kind), 8))
    results = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "args": vars(args), "traces": {}}
    for name, tokens, rpn in inputs:
        r = replay(tokens, ranks_per_node=rpn, budget=args.budget, overlap_degree=args.overlap_degree,
                   window=args.window)
        results["traces"][name] = r
        print(f"\n{name} {tuple(tokens.shape)} (steps, layers, experts, ranks), {rpn} ranks per node, "
              f"{float(tokens.sum()) / (tokens.shape[0] * tokens.shape[1] * tokens.shape[3]):.0f} rows per rank, "
              f"expert {r['expert_mb']:.1f} MB")
        print(f"{'arm':>22} {'straggler':>9} {'bound':>6} {'inter-node':>10} {'time/EP':>8} {'+window':>8} "
              f"{'+transfer':>9} {'replicas':>8} {'MB/layer':>8}")
        for arm in ARMS:
            a = r[arm]
            print(f"{arm:>22} {a['straggler']:>9.3f} {a['bound']:>6.3f} {a['inter']:>10.4f} {a['time']:>8.3f} "
                  f"{a['time_window']:>8.3f} {a['time_transfer']:>9.3f} {a['replicas']:>8.2f} {a['replica_mb']:>8.1f}")
        print(f"median planning time per layer in this replay (dense [E, D, D] plans and the load sum "
              f"included; the runtime's compact path is timed by benchmarks/planning.py): "
              + ", ".join(f"{k} {v:.0f} us" for k, v in r["plan_us_median"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""The pre-gating placements side by side in the cluster simulator: ``paper`` (Algorithm 1, what
``python -m ds_fssdp.sim`` models, the runtime's default) and ``joint``, each through
``planner.place`` with the balancing dispatcher (3% slack) or the dispatch modes asked for, FSSDP
policy.

    python benchmarks/placement_clusters.py [--clusters a,b] [--model gpt-s-moe] [--gpus 32]
                                            [--steps 100] [--dispatches balanced[,balanced-time,paper]]
                                            [--json out.json]

``--dispatches``: each placement with each dispatch mode (the runtime's dispatcher of that mode,
with the cost model: "balanced-time" is priced as the runtime would). Arms are named
``placement`` for the default "balanced", else ``placement/dispatch``.

Per cluster: modelled iteration time and its breakdown, straggler, replicas per layer, inter-node
token bytes, on the shared recorded trace remapped to the cluster and model. A model, not a
measurement.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from ds_fssdp.config import FSSDPConfig
from ds_fssdp.sim.presets import cluster_preset, model_preset
from ds_fssdp.sim.setup import build_setup
from ds_fssdp.sim.cluster import simulate
from ds_fssdp.sim.workload import trace_for_setup

HERE = os.path.dirname(os.path.abspath(__file__))
PLACEMENTS = ("paper", "joint")  # ("cost" was removed: results/placement_clusters.json, results/README.md)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clusters", default="a,b")
    p.add_argument("--model", default="gpt-s-moe")
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dispatches", default="balanced")
    p.add_argument("--trace", default=os.path.join(HERE, "..", "..", "shared", "data", "trace_e8.npz"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    slack = float(FSSDPConfig().dispatch_slack)
    out = {"args": vars(args), "clusters": {}}
    for name in args.clusters.split(","):
        cluster, model = cluster_preset(name), model_preset(args.model)
        setup = build_setup(cluster, model, args.gpus)
        trace, _ = trace_for_setup(setup, args.trace, top_k=model.top_k, steps=args.steps)
        rows = {}  # "paper" (balanced) first: the ratios' baseline
        for mode in args.dispatches.split(","):
            for placement in PLACEMENTS:
                (r, ) = simulate(setup, trace.tokens_SLED, ["fssdp"], placement=placement, dispatch=mode,
                                 dispatch_slack=slack)
                rows[placement if mode == "balanced" else f"{placement}/{mode}"] = r.to_dict()
        out["clusters"][name] = rows
        print(f"\ncluster {name}, {args.model}, {args.gpus} GPUs, {args.steps} steps of {os.path.basename(args.trace)}")
        print(f"{'placement':>9} {'iter ms':>8} {'comp':>7} {'a2a':>7} {'spag':>7} {'straggler':>9} {'replicas':>8} "
              f"{'inter GB':>8}")
        for placement, r in rows.items():
            b = r["breakdown_ms"]
            print(f"{placement:>9} {r['iteration_ms']:>8.2f} {b['comp']:>7.2f} {b['a2a']:>7.2f} {b['spag']:>7.2f} "
                  f"{r['straggler']:>9.3f} {r['replicas_per_layer']:>8.2f} {r['inter_node_gb']:>8.3f}")
        for arm, r in rows.items():
            print(f"{arm} / paper iteration time: {r['iteration_ms'] / rows['paper']['iteration_ms']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

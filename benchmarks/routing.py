"""A rank's per-layer CPU work with the dispatch plan, each against what it replaced (same inputs,
same result, checked): ``route`` (index math, in C) against ``route_reference`` (key sorts), and
the layer's link statistics from ``DispatchPlan.moved`` against the [D, D] traffic table masked
by node.

    python benchmarks/routing.py [--experts 64 --ranks 32 --nodes 4 --tokens 8192 --top-k 2]
                                 [--repeats 200] [--json out.json]

Input: one rank's top-k routing of ``--tokens`` tokens drawn from a skewed expert distribution
(softmax of Gaussian logits, scale ``--skew``), the balancing dispatch plan of the joint placement
for tokens counts of that shape (this rank's column being its routing). Warm-up first; median
microseconds per call and the ratios, single thread.
"""
from __future__ import annotations

import json
import os
import platform
import statistics

import layer_args
import torch

from ds_fssdp.moe.routing import route, route_reference
from ds_fssdp.planner.dispatch import dispatch_plan


def main():
    p = layer_args.parser(__doc__, repeats=200)
    p.add_argument("--top-k", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    E, D, K, T, rank = args.experts, args.ranks, args.top_k, args.tokens, 1
    layer = layer_args.routed_layer(args, rank=rank)
    topo, idx_TK, tokens_ED, placement_ED, local_E = (layer[k] for k in ("topology", "idx_TK", "tokens_ED",
                                                                         "placement_ED", "local_E"))
    plan = dispatch_plan(placement_ED, tokens_ED, topo, mode="balanced", slack=0.03)
    a, b = route(idx_TK, plan, rank=rank, local_E=local_E), route_reference(idx_TK, plan, rank=rank, local_E=local_E)
    for k in ("send_token", "unsend", "group_perm", "ungroup_perm"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    G = topo.ranks_per_node

    def moved_from_table():
        moved_DD = plan.traffic_DD().double().fill_diagonal_(0)
        same_DD = topo.same_node_DD()
        return int(moved_DD[same_DD].sum()), int(moved_DD[~same_DD].sum())

    assert plan.moved(G) == moved_from_table()
    arms = {"route": lambda: route(idx_TK, plan, rank=rank, local_E=local_E),
            "route_reference": lambda: route_reference(idx_TK, plan, rank=rank, local_E=local_E),
            "moved": lambda: plan.moved(G), "moved_from_table": moved_from_table}
    results = {}
    for name, fn in arms.items():
        results[name] = {"median_us": statistics.median(layer_args.sorted_times_us(fn, repeats=args.repeats))}
    us = {name: r["median_us"] for name, r in results.items()}
    ratios = {"reference_over_route": us["route_reference"] / us["route"],
              "table_over_moved": us["moved_from_table"] / us["moved"]}
    print(f"E={E} D={D} K={K}, {T} tokens on rank {rank}: route {us['route']:.0f} us, route_reference "
          f"{us['route_reference']:.0f} us ({ratios['reference_over_route']:.1f}x); link statistics: moved "
          f"{us['moved']:.0f} us, from the traffic table {us['moved_from_table']:.0f} us "
          f"({ratios['table_over_moved']:.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{platform.machine()} {os.cpu_count()} cores", "args": vars(args),
                       "results": results, **ratios}, f, indent=2)


if __name__ == "__main__":
    main()

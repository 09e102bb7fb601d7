"""A rank's per-layer host work on the critical path: from the all-gathered ``tokens_ED`` to the
launch of the token all-to-all, exactly as ``ShardedExperts.forward`` does it.

    python benchmarks/critical_path.py [--experts 64 --ranks 32 --nodes 4 --tokens 8192 --top-k 2]
                                       [--repeats 300] [--json out.json]

The span (``span``): the dispatch plan (``dispatch_plan``, balancing, 3% slack, C), the route's
send half (``route``: this rank's two [E, D] tables of the plan and the send order, cut from the
assignments grouped by expert, C) and the send order's copy to the layer's device (on a CPU run a
no-op). Not in it: the grouping by expert (``expert_order``: it needs no plan, so the runtime
takes it before the count all-gather), the route's other half (the unsend and compute orders,
computed on first use, after the all-to-all is launched: ``span+finish`` is the span with it),
the placement (planned in ``prefetch``, before the attention), the layer's statistics (``stats``:
rows per rank, straggler, link statistics ``DispatchPlan.moved``, EP rows: computed in
``ShardedExperts._stats`` after the exchange has returned), timed here for comparison, nor the
send buffer (``send_rows``: ``ops.permute_tokens`` of the hidden states, device work). ``route_device``
(the torch-ops route CUDA tensors take) is timed on CPU tensors for reference. Input: one rank's
top-k routing of ``--tokens`` tokens from a skewed expert distribution, the joint placement of
counts of that shape. Warm-up first; median and p95 microseconds, single thread; ``--runs`` alternates the arms.
"""
from __future__ import annotations

import json
import os
import platform
import statistics

import layer_args
import torch

from ds_fssdp import ops
from ds_fssdp.moe.routing import expert_order, route, route_device
from ds_fssdp.planner.dispatch import dispatch_plan

SLACK = 0.03


def main():
    p = layer_args.parser(__doc__, repeats=300)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    E, D, K, T, rank = args.experts, args.ranks, args.top_k, args.tokens, 1
    layer = layer_args.routed_layer(args, rank=rank)
    topo, idx_TK, tokens_ED, owner_E, placement_ED, local_E = (
        layer[k] for k in ("topology", "idx_TK", "tokens_ED", "owner_E", "placement_ED", "local_E"))
    x_TH = torch.randn(T, args.hidden)
    dev = x_TH.device
    G = topo.ranks_per_node

    grouped = expert_order(idx_TK, E)

    def span():
        plan = dispatch_plan(placement_ED, tokens_ED, topo, mode="balanced", slack=SLACK)
        r = route(idx_TK, plan, rank=rank, local_E=local_E, grouped=grouped)
        return r.send_token.to(dev), r

    def after_launch():  # the rest of the route, once the exchange is launched
        r = span()[1]
        return [t.to(dev) for t in (r.group_perm, r.ungroup_perm, r.unsend)]

    plan = dispatch_plan(placement_ED, tokens_ED, topo, mode="balanced", slack=SLACK)
    r = route(idx_TK, plan, rank=rank, local_E=local_E, grouped=grouped)

    def stats():  # what ShardedExperts._stats computes from the plan
        rows_D = plan.rows_D().double()
        moved = plan.moved(G)
        ep_rows_D = torch.zeros_like(rows_D).index_add_(0, owner_E, tokens_ED.sum(1).double())
        mean = float(rows_D.mean())
        return moved, rows_D.long().tolist(), float(rows_D.max()) / mean, float(ep_rows_D.max()) / mean

    arms = {"span": span,
            "plan": lambda: dispatch_plan(placement_ED, tokens_ED, topo, mode="balanced", slack=SLACK),
            "route": lambda: route(idx_TK, plan, rank=rank, local_E=local_E, grouped=grouped),
            "expert_order": lambda: expert_order(idx_TK, E),
            "span+finish": after_launch,
            "stats": stats,
            "send_rows": lambda: ops.permute_tokens(x_TH, r.send_token, lambda: r.unsend.view(-1, K)),
            "route_device_on_cpu": lambda: route_device(idx_TK, plan, rank=rank, local_E=local_E)}
    runs = {name: [] for name in arms}
    for run in range(args.runs):
        order = list(arms) if run % 2 == 0 else list(reversed(arms))
        for name in order:
            times = layer_args.sorted_times_us(arms[name], repeats=args.repeats, warmup=20)
            runs[name].append((statistics.median(times), times[int(0.95 * len(times))]))
    results = {name: {"median_us": statistics.median(m for m, _ in rs), "p95_us": statistics.median(q for _, q in rs),
                      "run_medians_us": [round(m, 1) for m, _ in rs]} for name, rs in runs.items()}
    print(f"E={E} D={D} K={K}, {T} tokens on rank {rank}, {args.runs} alternating runs, load average "
          f"{os.getloadavg()[0]:.2f}")
    for name, res in results.items():
        print(f"{name:>20}: median {res['median_us']:8.1f} us  p95 {res['p95_us']:8.1f} us  runs "
              f"{res['run_medians_us']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{platform.machine()} {os.cpu_count()} cores", "args": vars(args),
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

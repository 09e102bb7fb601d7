"""t by time against t from the window, FSSDP and FSSDP-RM, across clusters, models and sizes.

    python benchmarks/t_by_time.py [--clusters a,b] [--models gpt-s-moe,gpt-l-moe,phi-3.5-moe]
                                   [--gpus 16,32] [--steps 20] [--predictor window|oracle] [--json out.json]

Each workload runs ``python -m ds_fssdp.sim`` on the shared trace twice, with ``--t-by window``
(t is what the modelled window hides, as before) and ``--t-by time`` (t searched by the modelled
layer time from there, ``planner/overlap.py``, the runtime's "auto"), and reports each policy's
iteration time under both and their ratio (time / window; below 1 is faster). The claim it checks:
t by time loses to the window's t nowhere. A model, not a measurement. ``--predictor oracle``
plans every layer on the loads it then routes (``sim/foresight.py``): where t by time loses under
the window's prediction but not under the oracle, the loss is the prediction's, not the price's.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
POLICIES = ("fssdp", "fssdp-rm")


def run(cluster: str, model: str, gpus: int, steps: int, trace: str, t_by: str, predictor: str = "window") -> dict:
    from ds_fssdp.sim.__main__ import main
    out = io.StringIO()
    argv = ["--trace", trace, "--cluster", cluster, "--model", model, "--gpus", str(gpus), "--steps", str(steps),
            "--policies", "ep," + ",".join(POLICIES), "--t-by", t_by, "--predictor", predictor, "--no-png", "--json"]
    main(argv, out=out)
    d = json.loads(out.getvalue())
    return {r["policy"]: r["iteration_ms"] for r in d["results"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clusters", default="a,b")
    p.add_argument("--models", default="gpt-s-moe,gpt-l-moe,phi-3.5-moe")
    p.add_argument("--gpus", default="16,32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--trace", default=os.path.join(HERE, "..", "..", "shared", "data", "trace_e8.npz"),
                   help="a routing trace, or \"synthetic\" (default: the shared trace beside the checkout)")
    from ds_fssdp.sim.foresight import PREDICTORS
    p.add_argument("--predictor", default="window", choices=PREDICTORS,
                   help="the loads pre-gating plans on (python -m ds_fssdp.sim --predictor)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    rows = []
    for cluster in args.clusters.split(","):
        for model in args.models.split(","):
            for gpus in (int(g) for g in args.gpus.split(",")):
                with contextlib.redirect_stdout(sys.stderr):
                    window = run(cluster, model, gpus, args.steps, args.trace, "window", args.predictor)
                    by_time = run(cluster, model, gpus, args.steps, args.trace, "time", args.predictor)
                row = {"cluster": cluster, "model": model, "gpus": gpus, "ep_ms": window["ep"]}
                for pol in POLICIES:
                    row[f"{pol}_window_ms"], row[f"{pol}_time_ms"] = window[pol], by_time[pol]
                    row[f"{pol}_ratio"] = by_time[pol] / window[pol]
                rows.append(row)
                print(f"{cluster} {model:12s} {gpus:3d} GPUs | EP {window['ep']:8.1f} | "
                      + " | ".join(f"{pol} {window[pol]:8.1f} -> {by_time[pol]:8.1f} ms ({row[f'{pol}_ratio']:.3f})"
                                   for pol in POLICIES), flush=True)
    worst = max(r[f"{pol}_ratio"] for r in rows for pol in POLICIES)
    print(f"worst time / window ratio: {worst:.3f} over {len(rows)} workloads x {len(POLICIES)} policies")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "predictor": args.predictor, "rows": rows, "worst_ratio": worst}, f, indent=1)


if __name__ == "__main__":
    main()

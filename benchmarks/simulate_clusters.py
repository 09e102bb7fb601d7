"""The simulator's report grid: clusters x traces x models at one GPU count, as tables and JSON.

    python benchmarks/simulate_clusters.py --json results.json
    python benchmarks/simulate_clusters.py --clusters a,b --models gpt-s-moe --gpus 32 --steps 300 --jobs 2

Per (cluster, trace, model): the table ``python -m ds_fssdp.sim`` prints, and in the JSON the same
records plus the paper's reference ranges. Traces: the shared recorded trace (remapped to the
cluster and model, steps [start, start + steps)) and a synthetic one at the paper's skew. This is
a model, not a measurement: the machine it runs on does not matter (state it anyway: --json
records the host).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor

PAPER = {
    "themis_over_fastermoe": [1.26, 2.37], "themis_over_ep_max": 3.68, "ep_slowdown_vs_uniform": [1.48, 2.87],
    "avg_themis_over_ep": {"a": 2.41, "b": 2.60}, "predictor_r2": 0.99, "share_std": [0.034, 0.046]
}


def run_one(job: dict) -> dict:
    import torch

    from ds_fssdp.sim.presets import cluster_preset, model_preset
    from ds_fssdp.sim.report import format_table, to_json
    from ds_fssdp.sim.setup import build_setup
    from ds_fssdp.sim.cluster import simulate
    from ds_fssdp.sim.workload import trace_for_setup

    torch.set_num_threads(1)
    t0 = time.time()
    cluster, model = cluster_preset(job["cluster"]), model_preset(job["model"])
    memory = job.get("replica_memory_gb")
    setup = build_setup(cluster, model, job["gpus"], replica_memory_bytes=None if memory is None else memory * 1e9)
    trace, summary = trace_for_setup(setup, job["trace"], top_k=model.top_k, steps=job["steps"], start=job["start"],
                                     target_std=job["target_std"], seed=job["seed"])
    results = simulate(setup, trace.tokens_SLED, job["policies"])
    record = to_json(setup.summary(), summary, results)
    record["job"] = job
    record["wall_s"] = time.time() - t0
    record["table"] = format_table(setup.summary(), summary, results)
    return record


def plot_record(record: dict, path: str) -> None:
    from ds_fssdp.sim.plot import plot_results
    from ds_fssdp.sim.report import result_from_dict

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    plot_results(path, [result_from_dict(r) for r in record["results"]],
                 title=f"{record['setup']['label']}; {record['trace'].get('description', '')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clusters", default="a,b")
    p.add_argument("--models", default="gpt-s-moe")
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--trace", default="/work/shared/data/trace_e8.npz", help="recorded trace ('' to skip)")
    p.add_argument("--start", type=int, default=200)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--synthetic-std", default="0.04", help="comma-separated skews ('' to skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="ep,uniform,fastermoe,smartmoe,flexmoe,fssdp,fssdp-rm")
    p.add_argument("--replica-memory-gb", type=float, default=None,
                   help="memory per rank for replicas / reserves (default: the cluster preset's 10%% of HBM)")
    p.add_argument("--jobs", type=int, default=1, help="processes (each single-threaded)")
    p.add_argument("--json", default=None, help="write all records here")
    p.add_argument("--png-dir", default=None, help="write one chart per record here")
    args = p.parse_args(argv)
    jobs = []
    for cluster in args.clusters.split(","):
        for model in args.models.split(","):
            base = dict(cluster=cluster, model=model, gpus=args.gpus, steps=args.steps, seed=args.seed,
                        policies=args.policies.split(","), target_std=0.04, start=0,
                        replica_memory_gb=args.replica_memory_gb)
            if args.trace:
                jobs.append(dict(base, trace=args.trace, start=args.start))
            for std in filter(None, args.synthetic_std.split(",")):
                jobs.append(dict(base, trace="synthetic", target_std=float(std)))
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        records = list(pool.map(run_one, jobs))
    for i, rec in enumerate(records):
        if args.png_dir:
            plot_record(rec, os.path.join(args.png_dir, f"sim_{i}_{rec['job']['cluster']}_{rec['job']['model']}_"
                                          f"{'synthetic' if rec['job']['trace'] == 'synthetic' else 'recorded'}.png"))
        print(rec["table"])
        print(f"(simulated in {rec['wall_s']:.0f} s)\n")
    if args.json:
        out = {"paper": PAPER, "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                                        "python": platform.python_version()}, "records": records}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

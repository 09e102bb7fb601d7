"""The simulator at cluster scale: fixed models x GPU counts x group sizes, EP with EDP vs FSSDP groups.

    python benchmarks/simulate_scale.py --gpus 64,256,1024 --json benchmarks/results/simulate_scale_b_1024.json
    python benchmarks/simulate_scale.py --gpus 4096 --group-sizes 8,64,256 --json .../simulate_scale_b_4096.json
    python benchmarks/simulate_scale.py --table benchmarks/results/simulate_scale_b_*.json   # docs/scale.md's table

Per (model, GPU count) one load-CV trace (``ds_fssdp.sim.cluster``, generated as it is read) is
replayed through EP at every group size it can run (N <= E: DeepSpeed's ``ep_size`` divides the
experts) and through ``fssdp`` and ``fssdp-rm`` at every group size, uncapped (m from 10 % of HBM,
the presets' default) and at each ``--caps`` (m such that model states stay within the cap times
EP's at the same group size). ``--table`` picks, per model, GPU count and cap, the FSSDP
configuration with the least time per iteration (``total_s``: iteration + count all-gather +
measured planning after gating) and compares it with EP at the same group size (EP's largest,
E, when the group is larger) and with EP's best group size. A model, not a measurement: state the
host anyway (--json records it and the CPU seconds each job took).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor

MODELS = "mixtral-8x7b,qwen3-30b-a3b,deepseek-v3-671b"


def run_job(job: dict) -> dict:
    import torch

    from ds_fssdp.sim.cluster import PolicyRun, check_group_size, run_cluster
    from ds_fssdp.sim.presets import cluster_preset, model_preset
    from ds_fssdp.sim.setup import build_setup
    from ds_fssdp.sim.workload import cv_workload

    torch.set_num_threads(1)
    wall, cpu = time.time(), time.process_time()
    model = model_preset(job["model"])
    setup = build_setup(cluster_preset(job["cluster"]), model, job["gpus"], calibration=False,
                        tokens_per_gpu=job.get("tokens_per_gpu"))
    sizes = []
    for n in job["group_sizes"]:
        try:
            check_group_size(n, setup.topology)
            sizes.append(n)
        except ValueError:
            pass
    runs = [PolicyRun("ep", setup, group_size=n, max_groups=job["max_groups"])
            for n in sorted({min(n, setup.num_experts) for n in sizes})]
    for n in sizes:
        for cap in job["caps"]:
            runs += [PolicyRun(name, setup, group_size=n, memory_cap=cap, max_groups=job["max_groups"])
                     for name in ("fssdp", "fssdp-rm")]
    source = cv_workload(setup, top_k=model.top_k, steps=job["steps"], load_cv_target=job["load_cv"],
                         seed=job["seed"])
    results = run_cluster(runs, source)
    return {"job": job, "setup": setup.summary(), "trace": source.summary(setup.load_window),
            "results": [r.to_dict() for r in results], "wall_s": time.time() - wall,
            "cpu_s": time.process_time() - cpu}


def best_rows(record: dict, cap) -> dict:
    """The fastest FSSDP configuration at ``cap`` and the EP runs to compare it with."""
    res = record["results"]
    ep = {r["group_size"]: r for r in res if r["policy"] == "ep"}
    ours = [r for r in res if r["policy"] != "ep" and r["memory_cap"] == cap]
    best = min(ours, key=lambda r: r["total_ms"])
    same = ep[min(best["group_size"], record["setup"]["num_experts"])]
    ep_best = min(ep.values(), key=lambda r: r["total_ms"])
    return {"best": best, "ep_same": same, "ep_best": ep_best}


def table(records: list, caps: list) -> str:
    lines = ["| model | GPUs | tokens / GPU | cap | best FSSDP (group, m) | ms / iter | x EP same group | EP group | "
             "x best EP (group) | memory GB (EP) | planning ms (post) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec in sorted(records, key=lambda r: (r["job"]["model"], r["setup"]["tokens_per_gpu"], r["job"]["gpus"])):
        for cap in caps:
            row = best_rows(rec, cap)
            b, s, e = row["best"], row["ep_same"], row["ep_best"]
            gb = sum(b["memory_gb"].values())
            lines.append(f"| {rec['job']['model']} | {rec['job']['gpus']} | {rec['setup']['tokens_per_gpu']} | "
                         f"{'none' if cap is None else cap} | "
                         f"{b['policy']} {b['group_size']}, m={b['budget']} | {b['total_ms']:.0f} | "
                         f"{s['total_ms'] / b['total_ms']:.2f} | {s['group_size']} | "
                         f"{e['total_ms'] / b['total_ms']:.2f} ({e['group_size']}) | "
                         f"{gb:.0f} ({sum(s['memory_gb'].values()):.0f}) | {b['planning_ms']['post_gating']:.1f} |")
    return "\n".join(lines)


def _caps(text: str) -> list:
    return [None if c == "none" else float(c) for c in text.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="b")
    p.add_argument("--models", default=MODELS)
    p.add_argument("--gpus", default="64,256,1024")
    p.add_argument("--group-sizes", default="8,64,256,1024")
    p.add_argument("--caps", default="none,1.2", help="comma-separated memory caps ('none': the default m)")
    p.add_argument("--steps", type=int, default=8, help="steps per trace (the first 5 fill the load window)")
    p.add_argument("--load-cv", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-groups", type=int, default=32, help="groups simulated per run (see PolicyRun)")
    p.add_argument("--tokens-per-gpu", type=int, default=None, help="default: the presets' (one 4096-token sequence)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--table", nargs="+", default=None, help="print the markdown table of these JSON files")
    args = p.parse_args(argv)
    caps = _caps(args.caps)
    if args.table:
        records = []
        for path in args.table:
            with open(path) as f:
                records += json.load(f)["records"]
        print(table(records, caps))
        return 0
    jobs = [dict(cluster=args.cluster, model=m, gpus=int(g), group_sizes=[int(n) for n in args.group_sizes.split(",")],
                 caps=caps, steps=args.steps, load_cv=args.load_cv, seed=args.seed, max_groups=args.max_groups,
                 tokens_per_gpu=args.tokens_per_gpu)
            for g in args.gpus.split(",") for m in args.models.split(",")]
    records = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for rec in pool.map(run_job, jobs):
            records.append(rec)
            print(f"{rec['job']['model']} {rec['job']['gpus']} GPUs: {rec['cpu_s']:.0f} CPU s", flush=True)
            if args.json:  # rewritten after every job: a long sweep keeps what it has
                out = {"host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                                "python": platform.python_version()}, "records": records}
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
    print(table(records, caps))
    return 0


if __name__ == "__main__":
    sys.exit(main())

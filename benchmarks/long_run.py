"""Long run: does memory stay flat over hundreds of steps with drifting skew?

    python benchmarks/long_run.py [--steps 500] [--world 2] [--report-every 50] [--json out.json]

``--world`` gloo CPU ranks train the example GPT-MoE under ``fssdp`` (replicas planned every
iteration, owners re-sharded every ``--reshard-interval`` steps) on a token stream whose hot region
drifts round the vocabulary, so routing skew drifts too and placements, replicas and owners keep
changing. Every ``--report-every`` steps each rank reports, after ``engine.step()``:

* RSS (``/proc/self/statm``), Python objects (less the script's own reports) and tensors alive (``gc``);
* replica bytes still alive between steps (must be 0) and the peak within the step;
* live replica buffers, pending reduce-scatters, started gathers (must be 0);
* expert state bytes on the rank (fp32 masters + optimizer rows; moves with re-sharding) and in
  the group (must be constant).

Verdict ``flat``: after the warm-up (a quarter of the steps) RSS grows by at most
max(16 MiB, 2 %) on every rank, no replica byte, buffer or collective outlives any step, the
group's expert state bytes never change, and the objects / tensors alive do not grow.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
import warnings

import torch
import torch.multiprocessing as mp

MIB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def drifting_batch(step: int, rank: int, cfg, micro: int):
    """Tokens drawn around a centre that moves one token every 3 steps (wrapping), sharply
    peaked: the gate's favourite experts drift with it."""
    V = cfg.vocab_size
    centre = (step / 3.0) % V
    dist_V = torch.remainder(torch.arange(V, dtype=torch.float) - centre, V)
    dist_V = torch.minimum(dist_V, V - dist_V)
    probs = torch.exp(-(dist_V / 4.0)**2) + 0.02
    gen = torch.Generator().manual_seed(1_000_003 * step + 101 * rank + 7)
    seq = torch.multinomial(probs, micro * (cfg.seq_len + 1), replacement=True, generator=gen)
    seq = seq.view(micro, cfg.seq_len + 1)
    return seq[:, :-1], seq[:, 1:]


def _probe(engine, step: int, elapsed: float, *, held: int) -> dict:
    """``held``: Python objects this script's own reports keep alive (not counted)."""
    stage = engine.fssdp
    shards = stage.shards
    opt = stage.optimizer
    state_bytes = 0
    for s in shards:
        state_bytes += s.master.numel() * s.master.element_size()
        for v in opt.state.get(s.master, {}).values():
            if torch.is_tensor(v) and v.dim() == 2:
                state_bytes += v.numel() * v.element_size()
    with warnings.catch_warnings():  # gc.get_objects() holds deprecated proxies that warn on inspection
        warnings.simplefilter("ignore")
        objs = gc.get_objects()
        tensors = sum(1 for o in objs if torch.is_tensor(o))
    return {"step": step, "rss_mib": rss_bytes() / MIB, "replica_bytes_alive": stage.memory.current,
            "replica_bytes_peak": stage.last_step.get("replica_bytes_peak", 0),
            "live_replica_buffers": sum(len(s._live) for s in shards),
            "pending_reduces": sum(len(s._pending) for s in shards),
            "started_gathers": sum(s._gather is not None for s in shards),
            "expert_state_bytes": state_bytes, "objects": len(objs) - held,
            "tensors": tensors,
            "owned_experts": [int(s.owned_E.numel()) for s in shards], "s_per_step": elapsed}


def _worker(rank, world, port, args, out_path):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_SIZE": str(world)})
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as tdist

    import ds_fssdp
    from ds_fssdp.models import GPTMoE, GPTMoEConfig
    from ds_fssdp.runtime.cpu import skip_shm_comm_build
    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTMoEConfig(vocab_size=128, seq_len=32, d_model=48, n_heads=4, n_layers=2, ffn_hidden=96, num_experts=8,
                       k=2, aux_loss_coef=0.01, init_std=0.05)
    micro = 4
    ds_cfg = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "train_batch_size": micro * world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
        "fssdp": {"policy": "fssdp", "materialization_budget": 2, "overlap_degree": 4, "load_window": 5,
                  "reshard_interval": args.reshard_interval, "metrics_csv": None},
    }
    torch.manual_seed(0)
    model = GPTMoE(cfg)
    engine, *_ = ds_fssdp.initialize(model=model, config=ds_cfg)
    reports, losses, replicas = [], [], []
    t_last = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = drifting_batch(step, rank, cfg, micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        replicas.append(sum(layer.last_stats["replicas"] for layer in model.moe_layers()))
        if step % args.report_every == 0 or step == 1:
            now = time.perf_counter()
            gc.collect()
            per_step = (now - t_last) / (args.report_every if step > 1 else 1)
            reports.append(_probe(engine, step, per_step, held=2 * len(reports)))  # a dict and a list each
            t_last = time.perf_counter()
    gathered = [None] * world
    tdist.all_gather_object(gathered, {"reports": reports, "losses": losses, "replicas": replicas})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


def verdict(per_rank: list, steps: int) -> dict:
    warm = max(1, steps // 4)
    checks = {}
    growth = []
    for rank, part in enumerate(per_rank):
        reps = [r for r in part["reports"] if r["step"] >= warm]
        base, last = reps[0], reps[-1]
        rss_growth = last["rss_mib"] - base["rss_mib"]
        growth.append(rss_growth)
        checks[f"rank{rank}_rss_flat"] = rss_growth <= max(16.0, 0.02 * base["rss_mib"])
        checks[f"rank{rank}_nothing_outlives_a_step"] = all(
            r["replica_bytes_alive"] == r["live_replica_buffers"] == r["pending_reduces"] == r["started_gathers"] == 0
            for r in part["reports"])
        checks[f"rank{rank}_objects_flat"] = last["objects"] <= base["objects"] + 50
        checks[f"rank{rank}_tensors_flat"] = last["tensors"] <= base["tensors"] + 20
    group_state = [sum(p["reports"][i]["expert_state_bytes"] for p in per_rank)
                   for i in range(len(per_rank[0]["reports"]))]
    # The first report precedes the first step's optimizer state on some configs: compare from the second.
    checks["group_expert_state_constant"] = len(set(group_state[1:])) == 1
    return {"flat": all(checks.values()), "checks": checks, "rss_growth_mib_after_warmup": growth,
            "group_expert_state_bytes": group_state[-1]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--report-every", type=int, default=50)
    ap.add_argument("--reshard-interval", type=int, default=50)
    ap.add_argument("--json", default=None, help="write the reports and the verdict here")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "long_run.json")
        mp.spawn(_worker, args=(args.world, port, args, out_path), nprocs=args.world, join=True)
        with open(out_path) as f:
            per_rank = json.load(f)
    wall = time.perf_counter() - t0
    print(f"long run: {args.steps} steps, {args.world} gloo CPU ranks, GPT-MoE (2 MoE layers, 8 experts), fssdp, "
          f"re-shard every {args.reshard_interval} steps, drifting skew; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}; {wall:.0f} s wall")
    cols = ("step", "rss_mib", "replica_bytes_alive", "replica_bytes_peak", "live_replica_buffers", "pending_reduces",
            "expert_state_bytes", "owned_experts", "objects", "tensors", "s_per_step")
    for rank, part in enumerate(per_rank):
        print(f"\nrank {rank}")
        print("  ".join(f"{c:>12}" for c in cols))
        for r in part["reports"]:
            cells = [f"{r[c]:.1f}" if c == "rss_mib" else f"{r[c]:.3f}" if c == "s_per_step" else str(r[c])
                     for c in cols]
            print("  ".join(f"{c:>12}" for c in cells))
    replicas = per_rank[0]["replicas"]
    losses = per_rank[0]["losses"]
    print(f"\nreplicas per iteration (both layers): mean {sum(replicas) / len(replicas):.2f}, max {max(replicas)}; "
          f"loss {losses[0]:.3f} -> {sum(losses[-20:]) / 20:.3f} (mean of the last 20); "
          f"finite: {all(math.isfinite(l) for l in losses)}")
    v = verdict(per_rank, args.steps)
    print(f"verdict: {'FLAT' if v['flat'] else 'NOT FLAT'}  "
          f"(RSS growth after warm-up: {', '.join(f'{g:+.1f} MiB' for g in v['rss_growth_mib_after_warmup'])}; "
          f"failed checks: {[k for k, ok in v['checks'].items() if not ok] or 'none'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "wall_s": wall, "ranks": per_rank, "verdict": v}, f, indent=1)
    return 0 if v["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())

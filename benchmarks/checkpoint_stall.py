"""Checkpoint stall: how long a save stops training, synchronous against asynchronous.

    python benchmarks/checkpoint_stall.py [--rounds 4] [--window 4] [--world 2] [--json out.json]

``--world`` gloo CPU ranks train the main job's model (``ds_fssdp.models.GPTMoE``, sized with
``--d-model`` / ``--ffn`` / ``--layers`` / ``--experts`` so that a checkpoint is large enough to
take noticeable time) with AdamW under ``fssdp``. After a warm-up (steps, one save of each kind),
every round runs three arms, alternating their order round by round (A B C, C B A, ...):

* ``none``: ``--window`` steps, no save;
* ``sync``: ``engine.save_checkpoint(...)``, then ``--window`` steps;
* ``async``: ``engine.save_checkpoint(..., async_save=True)``, then ``--window`` steps while the
  files are written in the background, then ``engine.wait_for_checkpoint()`` (the background
  write's own duration is reported too).

Reported per arm (the slowest rank's time, median and range over the rounds): the stall (the save
call), the mean step time in the window, the wait left at its end, and the total (stall + window
+ wait); derived: the stall per save (``sync`` and ``async``), the step time during a background
write against without (``async`` / ``none``), and the cost of a save (total minus ``none``'s).
Checkpoints go to a temporary directory on the local disk and are deleted between rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ARMS = ("none", "sync", "async")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window", type=int, default=4, help="steps timed after each save (or without one)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the first timed round")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="write the per-round times and the summary here")
    args = ap.parse_args(argv)
    for key in ("rounds", "window", "world", "d_model", "ffn", "layers", "experts", "seq_len", "micro_batch"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} ({getattr(args, key)}) must be >= 1")
    return args


def _batch(step: int, rank: int, args):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    seq = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _engine(args):
    import ds_fssdp
    from ds_fssdp.models import GPTMoE, GPTMoEConfig
    torch.manual_seed(0)
    model = GPTMoE(GPTMoEConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_heads=4,
                                n_layers=args.layers, ffn_hidden=args.ffn, num_experts=args.experts, k=2))
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
           "train_batch_size": args.micro_batch * args.world, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 0},
           "fssdp": {"policy": "fssdp", "metrics_csv": None}}
    engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
    return engine


def _steps(engine, rank, start: int, n: int, args) -> list:
    times = []
    for step in range(start, start + n):
        t = time.perf_counter()
        x, y = _batch(step, rank, args)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def _arm(engine, rank, arm: str, *, step: int, save_dir: str, tag: str, args) -> dict:
    t = time.perf_counter()
    if arm != "none":
        engine.save_checkpoint(save_dir, tag=tag, async_save=arm == "async")
    stall = time.perf_counter() - t
    steps = _steps(engine, rank, step, args.window, args)
    pending = arm == "async" and engine.fssdp_checkpoint_writer.pending
    t = time.perf_counter()
    engine.wait_for_checkpoint()
    wait = time.perf_counter() - t
    write = engine.fssdp_checkpoint_writer.last_seconds if arm == "async" else 0.0
    return {"stall_s": stall, "step_s": steps, "wait_s": wait, "pending_after_window": pending,
            "background_write_s": write, "total_s": stall + sum(steps) + wait}


def _worker(rank, world, port, args, save_root, out_path):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_SIZE": str(world)})
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm as dist

    from ds_fssdp.runtime.cpu import skip_shm_comm_build
    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(args)
    step = 0
    _steps(engine, rank, step, args.warmup, args)
    step += args.warmup
    for arm in ("sync", "async"):  # warm-up of both save paths
        _arm(engine, rank, arm, step=step, save_dir=save_root, tag=f"warmup-{arm}", args=args)
        step += args.window
    ckpt = os.path.join(save_root, "warmup-sync")
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
    rounds = []
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
        got = {}
        for arm in order:
            got[arm] = _arm(engine, rank, arm, step=step, save_dir=save_root, tag=f"r{r}-{arm}", args=args)
            step += args.window
        dist.barrier()
        if rank == 0:  # keep the disk use bounded; not timed
            for name in os.listdir(save_root):
                if name.startswith("r"):
                    shutil.rmtree(os.path.join(save_root, name))
        dist.barrier()
        rounds.append({"order": list(order), **got})
    result = {"rank": rank, "checkpoint_bytes": nbytes, "rounds": rounds}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


def summarize(per_rank: list) -> dict:
    """Per round and arm the slowest rank's times; median and range over the rounds."""
    rounds = len(per_rank[0]["rounds"])

    def slowest(r, arm, key):
        values = [p["rounds"][r][arm][key] for p in per_rank]
        values = [statistics.mean(v) if isinstance(v, list) else v for v in values]
        return max(values)

    def stats(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    arms = {arm: {key: stats([slowest(r, arm, key) for r in range(rounds)])
                  for key in ("stall_s", "step_s", "wait_s", "background_write_s", "total_s")} for arm in ARMS}
    for arm in ARMS:
        arms[arm]["pending_after_window"] = [any(p["rounds"][r][arm]["pending_after_window"] for p in per_rank)
                                             for r in range(rounds)]
    none_total = [slowest(r, "none", "total_s") for r in range(rounds)]
    none_step = [slowest(r, "none", "step_s") for r in range(rounds)]
    derived = {
        "stall_async_over_sync": stats([slowest(r, "async", "stall_s") / slowest(r, "sync", "stall_s")
                                        for r in range(rounds)]),
        "step_during_async_write_over_none": stats([slowest(r, "async", "step_s") / none_step[r]
                                                    for r in range(rounds)]),
        "step_after_sync_save_over_none": stats([slowest(r, "sync", "step_s") / none_step[r] for r in range(rounds)]),
        "cost_per_save_s": {arm: stats([slowest(r, arm, "total_s") - none_total[r] for r in range(rounds)])
                            for arm in ("sync", "async")},
    }
    return {"arms": arms, "derived": derived}


def main(argv=None):
    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as save_root, tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "stall.json")
        mp.spawn(_worker, args=(args.world, port, args, save_root, out_path), nprocs=args.world, join=True)
        with open(out_path) as f:
            per_rank = json.load(f)
    wall = time.perf_counter() - t0
    summary = summarize(per_rank)
    mib = sum(p["checkpoint_bytes"] for p in per_rank[:1]) / (1 << 20)
    print(f"checkpoint stall: {args.world} gloo CPU ranks, GPTMoE d_model {args.d_model}, ffn {args.ffn}, "
          f"{args.layers} layers x {args.experts} experts, AdamW; checkpoint {mib:.0f} MiB; {args.rounds} rounds x "
          f"{args.window} steps; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; {wall:.0f} s wall")
    print(f"{'arm':>6} {'stall s':>18} {'step s (window)':>18} {'wait s':>18} {'total s':>18}")
    for arm, a in summary["arms"].items():
        cells = [f"{a[k]['median']:.3f} [{a[k]['min']:.3f}-{a[k]['max']:.3f}]"
                 for k in ("stall_s", "step_s", "wait_s", "total_s")]
        print(f"{arm:>6} " + " ".join(f"{c:>18}" for c in cells))
    d = summary["derived"]
    write = summary["arms"]["async"]["background_write_s"]
    print(f"background write (async): {write['median']:.3f} s [{write['min']:.3f}-{write['max']:.3f}]")
    print(f"stall per save: async/sync {d['stall_async_over_sync']['median']:.3f} "
          f"[{d['stall_async_over_sync']['min']:.3f}-{d['stall_async_over_sync']['max']:.3f}]; "
          f"step time during the background write / without a save "
          f"{d['step_during_async_write_over_none']['median']:.2f} "
          f"[{d['step_during_async_write_over_none']['min']:.2f}-{d['step_during_async_write_over_none']['max']:.2f}]; "
          f"cost per save (total - none): sync {d['cost_per_save_s']['sync']['median']:.3f} s, "
          f"async {d['cost_per_save_s']['async']['median']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "wall_s": wall, "machine": {"cpus": os.cpu_count(),
                       "torch": torch.__version__}, "checkpoint_mib": mib, "summary": summary,
                       "ranks": per_rank}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

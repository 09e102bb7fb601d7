"""Validation of the schedule model: the per-layer forward + backward time of the MoE layer's
exchange + expert compute that the simulator's accounting predicts (``planner.schedule.layer_time``
with the ``ScheduleCosts`` fitted on this machine) against the runtime's measured time, on 2 gloo
CPU ranks.

    python benchmarks/validate_schedule.py [--policies ep,fssdp] [--json out.json]

The script spawns its 2 ranks itself (gloo, one torch thread each). Steps:

1. The cost model fitted on this machine, as the runtime fits it (``runtime/costfit.measure``: the
   token all-to-all over the group and the grouped expert MLP forward + backward, every rank's
   times agreed, ``schedule.fit_schedule_costs``), at sizes that span the run's (rows per peer and
   GEMM rows up to the layer's assignments per rank and beyond). Fitted once, before any arm: it
   is not fitted to the timings it predicts.
2. Per arm (policy ep, fssdp; pipeline degree 1, "auto" and a fixed (forward, backward) pair,
   ``--degrees``): a GPT-MoE on Zipf-skewed bytes through ``ds_fssdp.initialize``,
   ``--warmup`` steps, then ``--steps`` timed steps. Each layer records its own forward and
   backward span of dispatch + expert compute + combine (``moe/timing.py``: the runtime's own
   instrumentation) and the load that iteration had: bytes this rank moved per exchange over each
   link class, its rows for its own tokens and for other ranks', and the bytes of other
   collectives in flight during each direction (the next layer's replica gather, started early,
   when it has not landed as this layer's forward span starts; ``benchmarks/replica_spans.py``
   measures which are) (``schedule.LayerLoad``).
3. Per step and layer: measured = forward + backward span; predicted = ``schedule.layer_time``
   of that step's load at the arm's degrees. The exchange synchronises the ranks, so the layer's
   time is its slowest rank's: both sides take the max over the 2 ranks. Reported: median over the
   timed steps of each, their ratio predicted / measured per (arm, layer), and whether it is within
   ``--target`` (0.2: 20%).

On CPU ranks the costs are not concurrent (``ScheduleCosts.concurrent`` False, as the runtime's
fit sets it): gloo's threads and the compute share the same cores, so a chunked layer is modelled
as the sum of its parts; "auto" then chooses degree 1, and the fixed-degree arm checks the chunked
accounting; the other collectives' bytes are priced as one more exchange of the direction
(``schedule.other_traffic_s``; "without other" in the JSON: the same prediction without them).
What the model does not count (the permutations
around the exchange, the combine) is inside the measured span, so it shows up in the ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
from unittest import mock

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="ep,fssdp")
    p.add_argument("--degrees", default="1,auto,3x2", help="pipeline degrees: 1, auto, or FxB (forward x backward)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--ffn-hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--budget", type=int, default=2, help="fssdp.materialization_budget (m)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of each cost-fit measurement")
    p.add_argument("--target", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def batches(args, rank: int):
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    probs = 1.0 / torch.arange(1, 257, dtype=torch.float64).pow(args.zipf)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(7))
    while True:
        seq = perm[torch.multinomial(probs, args.micro_batch * (args.seq_len + 1), replacement=True, generator=gen)]
        seq = seq.view(args.micro_batch, args.seq_len + 1)
        yield seq[:, :-1], seq[:, 1:]


def arms(args) -> list:
    """(policy, degree) per arm: degree 1, "auto", or a fixed (forward, backward) pair ("3x2")."""
    degrees = []
    for d in args.degrees.split(","):
        degrees.append(d if d in ("1", "auto") else tuple(int(v) for v in d.split("x")))
    degrees = [1 if d == "1" else d for d in degrees]
    return [(p, d) for p in args.policies.split(",") for d in degrees]


def ds_config(args, policy: str, degree) -> dict:
    fssdp = {"policy": policy, "materialization_budget": args.budget, "overlap_degree": 4, "cost_refresh_interval": 0,
             "metrics_csv": None}
    fssdp["pipeline_degree"] = {"forward": degree[0], "backward": degree[1]} if isinstance(degree, tuple) else degree
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "fssdp": fssdp}


def fit_sizes(args, world: int) -> tuple:
    """Rows per peer of the exchange measurements and rows of the GEMM ones: spanning the run's."""
    assign = args.micro_batch * args.seq_len * args.k  # rows a rank sends per exchange (all of them)
    per_peer = sorted({max(1, assign // world // 8), max(2, assign // world // 2), assign // world, assign})
    gemm_rows = sorted({max(1, assign // 8), max(2, assign // 2), assign, assign * 3 // 2})
    return per_peer, gemm_rows


def measure_round(args, spec, repeats: int) -> dict:
    """One round of the runtime's initial measurements (this rank's times, not yet agreed)."""
    from deepspeed import comm as dist

    from ds_fssdp.runtime import costfit
    from ds_fssdp.topology import Topology
    world = dist.get_world_size()
    per_peer, gemm_rows = fit_sizes(args, world)
    token_bytes = args.d_model * 4
    samples = costfit.measure_exchange(group=None, topology=Topology(world, world), token_bytes=token_bytes,
                                       device="cpu", rows=per_peer, repeats=repeats)
    samples.update(costfit.measure_gemm(spec, dtype=torch.float32, device="cpu", rows=gemm_rows,
                                        experts=max(1, args.experts // world), repeats=repeats))
    return samples


def fit_rounds(rounds: list):
    """The per-size medians over measurement rounds, agreed (MAX over ranks) and fitted."""
    from ds_fssdp.planner.schedule import fit_schedule_costs
    from ds_fssdp.runtime import costfit
    merged = {k: [(u, statistics.median(r[k][i][1] for r in rounds)) for i, (u, _) in enumerate(rounds[0][k])]
              for k in rounds[0]}
    merged = costfit.agree_max(merged)
    # CPU ranks: gloo's threads share the compute's cores (ScheduleCosts.concurrent, as costfit.measure)
    costs, error = fit_schedule_costs(merged["intra"], merged["inter"], merged["gemm_fwd"], merged["gemm_bwd"],
                                      concurrent=False)
    return costs, error, merged


def model_cfg(args, GPTMoEConfig):
    return GPTMoEConfig(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, n_heads=4, n_layers=args.layers,
                        ffn_hidden=args.ffn_hidden, num_experts=args.experts, k=args.k)


def run_arm(args, rank, policy, degree, upfront):
    """Per timed step and layer: measured s, loads; the cost model measured between the steps
    (one round after each), and the predictions of both fits."""
    import ds_fssdp
    from ds_fssdp.models import GPTMoE, GPTMoEConfig
    from ds_fssdp.planner.schedule import LayerLoad, layer_time
    torch.manual_seed(args.seed)
    model = GPTMoE(model_cfg(args, GPTMoEConfig))
    spec = model.moe_layers()[0].spec
    from ds_fssdp.moe.sharded import ShardedExperts
    init = ShardedExperts.__init__

    def timed(self, *a, options, **k):  # the stage times layers only for its refits, off here
        init(self, *a, options=dataclasses.replace(options, timed=True), **k)

    # The layers record their spans (what this script measures) though no refit reads them here.
    with mock.patch.object(ShardedExperts, "__init__", timed):
        engine, *_ = ds_fssdp.initialize(model=model, config=ds_config(args, policy, degree))
    data = batches(args, rank)
    measured, loads, chosen, rounds = [], [], [], []
    for step in range(args.warmup + args.steps):
        x, y = next(data)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if step < args.warmup:
            continue
        m_row, l_row, c_row = [], [], []
        for layer in engine.fssdp.shards:
            (units, fwd_s), = layer.timings.samples("layer_fwd")[-1:]
            (_, bwd_s), = layer.timings.samples("layer_bwd")[-1:]
            m_row.append(fwd_s + bwd_s)
            l_row.append(LayerLoad(*units))
            c_row.append((layer.stats["pipeline_degree_fwd"], layer.stats["pipeline_degree_bwd"]))  # the runtime's
        measured.append(m_row)
        loads.append(l_row)
        chosen.append(c_row)
        rounds.append(measure_round(args, spec, repeats=1))
    engine.fssdp.close()
    costs, error, samples = fit_rounds(rounds)

    def predict(c, *, other=True):
        out = []
        for l_row, c_row in zip(loads, chosen):
            row = []
            for load, ch in zip(l_row, c_row):
                degrees = tuple(ch)  # the degrees the runtime ran at (its own decision under "auto")
                if not other:
                    load = LayerLoad(load.intra_bytes, load.inter_bytes, load.local_rows, load.remote_rows)
                row.append(layer_time(c, load, degrees))
            out.append(row)
        return out
    return {"measured": measured, "predicted": predict(costs), "predicted_upfront": predict(upfront),
            "predicted_without_other": predict(costs, other=False),
            "loads": [[list(vars(ld).values()) for ld in row] for row in loads], "costs": costs, "error": error,
            "samples": samples}


def worker(rank, world, args, port, out_path):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_SIZE": str(world),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    import deepspeed
    from deepspeed import comm as dist

    from ds_fssdp.runtime.cpu import skip_shm_comm_build
    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    from ds_fssdp.models import GPTMoE, GPTMoEConfig
    spec = GPTMoE(model_cfg(args, GPTMoEConfig)).moe_layers()[0].spec
    # The fit as at initialize, before any arm (rounds of the same measurements, back to back, after
    # two unrecorded rounds: a fresh process's first large allocations are slow on the CPU).
    for _ in range(2):
        measure_round(args, spec, repeats=1)
    upfront, upfront_error, upfront_samples = fit_rounds([measure_round(args, spec, repeats=1)
                                                          for _ in range(args.repeats)])
    results, fits = {}, {}
    for policy, degree in arms(args):
        arm = run_arm(args, rank, policy, degree, upfront)
        t = torch.tensor([arm["measured"], arm["predicted"], arm["predicted_upfront"],
                          arm["predicted_without_other"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the layer takes its slowest rank's time
        m, p, pu, po = t.tolist()
        per_layer = []
        for l in range(args.layers):
            med_m = statistics.median(row[l] for row in m)
            med_p = statistics.median(row[l] for row in p)
            med_pu = statistics.median(row[l] for row in pu)
            med_po = statistics.median(row[l] for row in po)
            per_layer.append({"measured_ms": med_m * 1e3, "predicted_ms": med_p * 1e3, "ratio": med_p / med_m,
                              "within_target": abs(med_p / med_m - 1) <= args.target,
                              "predicted_upfront_ms": med_pu * 1e3, "ratio_upfront": med_pu / med_m,
                              "predicted_without_other_ms": med_po * 1e3, "ratio_without_other": med_po / med_m,
                              "load_rank0_first_step": arm["loads"][0][l]})
        name = f"{policy}/degree={degree}"
        results[name] = per_layer
        fits[name] = {"schedule_costs": dataclasses.asdict(arm["costs"]), "fit_error": arm["error"],
                      "samples": arm["samples"]}
    if rank == 0:
        out = {"script": "benchmarks/validate_schedule.py", "args": vars(args), "host": platform.node(),
               "cpus": os.cpu_count(), "ranks": world, "load_average_at_end": os.getloadavg(),
               "degrees": args.degrees,
               "fits": fits, "upfront_fit": {"schedule_costs": dataclasses.asdict(upfront),
                                             "fit_error": upfront_error, "samples": upfront_samples},
               "results": results,
               "all_within_target": all(r["within_target"] for v in results.values() for r in v)}
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    torch.distributed.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(2, args, port, path), nprocs=2, join=True)
        with open(path) as f:
            out = json.load(f)
    print(f"degrees: {out['degrees']}; machine load average at the end {out['load_average_at_end']}")
    print(f"{'arm':24s} {'layer':>5s} {'predicted ms':>13s} {'measured ms':>12s} {'ratio':>6s}  (without other "
          f"collectives: ratio; fit up front: predicted, ratio)")
    for arm, layers in out["results"].items():
        for l, r in enumerate(layers):
            flag = "" if r["within_target"] else f"  outside {args.target:.0%}"
            print(f"{arm:24s} {l:5d} {r['predicted_ms']:13.2f} {r['measured_ms']:12.2f} {r['ratio']:6.3f}  "
                  f"({r['ratio_without_other']:.3f}; {r['predicted_upfront_ms']:.2f}, {r['ratio_upfront']:.3f}){flag}")
        f = out["fits"][arm]
        c = f["schedule_costs"]
        print(f"  fit: a2a {c['a2a_intra']['startup_s'] * 1e6:.0f} us + {c['a2a_intra']['per_unit_s'] * 1e9:.3f} ns/B,"
              f" gemm {c['gemm']['startup_s'] * 1e6:.0f} us + {c['gemm']['per_unit_s'] * 1e6:.2f} us/row, backward "
              f"x{c['backward_factor']:.2f}, relative error {f['fit_error']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

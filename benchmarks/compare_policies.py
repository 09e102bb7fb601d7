"""Every placement policy and DeepSpeed's own MoE layer, side by side on one model and one data
stream with skewed routing.

    deepspeed --num_gpus 2 benchmarks/compare_policies.py [--data zipf|corpus] [--json out.json]

One engine per arm (same model, same initial weights, same batches), all built up front in the
same processes; after a warm-up they run in alternating order (A B C ... then reversed), a few
steps at a time, and the times of each arm's steps are summed. Arms: the ``fssdp`` policies
(``fssdp``, ``fssdp-rm`` = with re-materialization, ``fssdp-joint`` / ``fssdp-paper`` = with
that ``placement``, ``fssdp-copies`` = with ``one_copy_per_destination`` off, ``fssdp-serial`` = with
``pipeline_degree`` 1, ``one_copy_per_destination`` and ``grads_in_gaps`` off, ``ep``, ``uniform``,
``fastermoe``, ``smartmoe``) through ``ds_fssdp.initialize``, and ``deepspeed-moe``: ``deepspeed.moe.layer.MoE``
(same shapes, top-2, dropless: ``drop_tokens=False``, expert parallel over all ranks) through
``deepspeed.initialize``. The MoE layers' experts: gelu, no biases.

Skewed routing: ``--data zipf`` feeds bytes drawn from a Zipf law (a few bytes dominate, so the
gate sends most tokens to a few experts); ``--data corpus`` feeds CPython's standard library
(the main job's corpus) after ``--train-steps`` of training on it, so the gate routes as a
trained gate does.

Reported per arm (rank 0 prints a table; ``--json`` writes it): tokens/s (all ranks), its ratio to
``uniform`` (the no-straggler reference) and to ``ep``; the straggler factor (max/mean rows per
rank); the load predictor's relative L1 error (how far the loads the placement was planned for
were from the actual ones); exposed gather / reduce seconds per step and as a share of the step; forward token
exchange bytes inside / between nodes; model-state bytes per rank (parameters, gradients,
optimizer states, replica peak).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import deepspeed
import torch
import torch.nn as nn
from deepspeed import comm as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE

import ds_fssdp
from ds_fssdp.data import load_corpus, sample_batch, split
from ds_fssdp.models import GPTMoE, GPTMoEConfig
from ds_fssdp.runtime.cpu import skip_shm_comm_build

ARMS = ("fssdp", "fssdp-rm", "ep", "uniform", "fastermoe", "smartmoe", "deepspeed-moe")
PLACEMENT_ARMS = {"fssdp-joint": "joint", "fssdp-paper": "paper"}  # fssdp, that placement
COPIES_ARM = "fssdp-copies"  # fssdp with one_copy_per_destination off (one row per assignment)
# fssdp with the layer schedule's switches off: pipeline_degree 1, one copy per assignment, the EDP
# reduce at the step (the schedule before issue 24, except that replicas are gathered early)
SERIAL_ARM = "fssdp-serial"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--data", choices=["zipf", "corpus"], default="zipf")
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the byte distribution")
    p.add_argument("--train-steps", type=int, default=30, help="--data corpus: training steps before timing")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--ffn-hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--budget", type=int, default=2, help="fssdp.materialization_budget (m)")
    p.add_argument("--overlap-degree", type=int, default=4, help="fssdp.overlap_degree (t)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps-per-round", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_known_args()[0]


def base_config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }


def build_arm(arm: str, args, world: int):
    cfg = GPTMoEConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, ffn_hidden=args.ffn_hidden,
                       num_experts=args.experts, k=2)
    torch.manual_seed(args.seed)
    model = GPTMoE(cfg)
    config = base_config(args)
    if arm == "deepspeed-moe":
        for block in model.blocks:
            template = nn.Sequential(nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False), nn.GELU(),
                                     nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False))
            block.moe = DeepSpeedMoE(cfg.d_model, template, num_experts=cfg.num_experts, ep_size=world, k=2,
                                     drop_tokens=False, capacity_factor=1.0)
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                       "name": "all"})
        opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.0)
        del config["optimizer"]
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        return engine, model
    policy = "fssdp" if arm in ("fssdp-rm", COPIES_ARM, SERIAL_ARM) or arm in PLACEMENT_ARMS else arm
    config["fssdp"] = {"policy": policy, "materialization_budget": args.budget, "overlap_degree": args.overlap_degree,
                       "rematerialize": arm == "fssdp-rm",
                       "one_copy_per_destination": arm not in (COPIES_ARM, SERIAL_ARM)}
    if arm == SERIAL_ARM:
        config["fssdp"].update(pipeline_degree=1, grads_in_gaps=False)
    if arm in PLACEMENT_ARMS:
        config["fssdp"]["placement"] = PLACEMENT_ARMS[arm]
    engine, *_ = ds_fssdp.initialize(model=model, config=config)
    return engine, model


def batches(args, rank: int, corpus_N):
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    if args.data == "corpus":
        while True:
            yield sample_batch(corpus_N, args.micro_batch, args.seq_len, gen)
    probs = 1.0 / torch.arange(1, 257, dtype=torch.float64).pow(args.zipf)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(7))
    while True:
        seq = perm[torch.multinomial(probs, args.micro_batch * (args.seq_len + 1), replacement=True, generator=gen)]
        seq = seq.view(args.micro_batch, args.seq_len + 1)
        yield seq[:, :-1], seq[:, 1:]


def step(engine, x, y) -> float:
    loss = engine(x.to(engine.device), y.to(engine.device))
    engine.backward(loss)
    engine.step()
    return loss.item()


def model_state_bytes(engine, model, replica_peak: int) -> dict:
    """Bytes per rank: parameters and gradients the rank keeps, optimizer states (incl. fp32
    partitions ZeRO keeps for its optimizer), expert shards and the replica peak."""
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    params = [p for p in model.parameters()]
    out = {"params": nbytes(params), "grads": nbytes(params)}
    opt = engine.basic_optimizer
    module_ids = {id(p) for p in params}
    states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    partitions = [p for g in opt.param_groups for p in g["params"] if id(p) not in module_ids]
    out["optimizer"] = nbytes(states) + nbytes(partitions)
    stage = getattr(engine, "fssdp", None)
    if stage is not None:
        rows = [s.rows for s in stage.shards]
        masters = [s.master for s in stage.shards if s.master is not s.rows]
        out["params"] += nbytes(rows)
        out["grads"] += nbytes(s.master for s in stage.shards)  # the fp32 gradient accumulator
        ex_states = [v for st in stage.optimizer.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0]
        out["optimizer"] += nbytes(ex_states) + nbytes(masters)
        out["replicas_peak"] = 2 * replica_peak  # replica rows and their gradients
    else:
        out["replicas_peak"] = 0
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    skip_shm_comm_build()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    arms = [a for a in args.arms.split(",") if a]
    corpus_N = split(load_corpus())[0] if args.data == "corpus" else None
    engines = {arm: build_arm(arm, args, world) for arm in arms}
    streams = {arm: batches(args, rank, corpus_N) for arm in arms}
    # Warm-up (and, for --data corpus, training the gates on the corpus), untimed.
    for arm, (engine, _) in engines.items():
        for _ in range(args.warmup + (args.train_steps if args.data == "corpus" else 0)):
            step(engine, *next(streams[arm]))
    totals = {arm: {"seconds": 0.0, "steps": 0, "layers": []} for arm in arms}
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            engine, model = engines[arm]
            data = [next(streams[arm]) for _ in range(args.steps_per_round)]
            dist.barrier()
            t0 = time.perf_counter()
            for x, y in data:
                step(engine, x, y)
                if hasattr(engine, "fssdp"):
                    totals[arm]["layers"].append([dict(l.last_stats) for l in model.moe_layers()])
                    totals[arm]["replica_peak"] = max(totals[arm].get("replica_peak", 0),
                                                      engine.fssdp.last_step["replica_bytes_peak"])
            dist.barrier()
            totals[arm]["seconds"] += time.perf_counter() - t0
            totals[arm]["steps"] += args.steps_per_round
    tokens_per_step = world * args.micro_batch * args.seq_len
    results = {}
    for arm in arms:
        engine, model = engines[arm]
        t = totals[arm]
        res = {"tokens_per_s": tokens_per_step * t["steps"] / t["seconds"], "step_s": t["seconds"] / t["steps"]}
        if t["layers"]:
            flat = [l for step_layers in t["layers"] for l in step_layers]
            mean = lambda key: sum(l.get(key, 0) for l in flat) / len(flat)
            per_step = lambda key: sum(l.get(key, 0) for l in flat) / len(t["layers"])
            res.update({
                "straggler": mean("straggler"),
                "ep_straggler": mean("ep_straggler"),
                "load_prediction_error": statistics.fmean(  # NaN before the first prediction: left out
                    [e for e in (l.get("load_prediction_error", math.nan) for l in flat) if not math.isnan(e)]
                    or [math.nan]),
                "replicas_per_layer": mean("replicas"),
                "gather_exposed_s": per_step("gather_exposed_s"),
                "reduce_exposed_s": per_step("reduce_exposed_s") + per_step("regather_exposed_s"),
                "a2a_bytes_intra": per_step("a2a_bytes_intra"),
                "a2a_bytes_inter": per_step("a2a_bytes_inter"),
                "a2a_bytes_saved": per_step("a2a_bytes_saved"),
                "a2a_meta_bytes": per_step("a2a_meta_bytes"),
                "gather_bytes": per_step("gather_bytes"),
            })
            res["exposed_share"] = (res["gather_exposed_s"] + res["reduce_exposed_s"]) / res["step_s"]
        res["model_state_bytes"] = model_state_bytes(engine, model, t.get("replica_peak", 0))
        results[arm] = res
    # Every rank measured the same wall time windows (barriers); report rank 0's view.
    if rank == 0:
        for arm, res in results.items():
            for ref in ("uniform", "ep", "deepspeed-moe", COPIES_ARM, SERIAL_ARM):
                if ref in results:
                    res[f"vs_{ref}"] = res["tokens_per_s"] / results[ref]["tokens_per_s"]
        print_table(results, args, world)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": f"{platform.machine()} {os.cpu_count()} cores", "ranks": world,
                           "threads_per_rank": args.threads, "args": vars(args), "results": results}, f, indent=2)


def print_table(results, args, world):
    print(f"\n{world} ranks x {args.threads} thread(s), data={args.data}, {args.layers} layers, "
          f"{args.experts} experts, d={args.d_model}, ffn={args.ffn_hidden}, "
          f"{args.micro_batch}x{args.seq_len} tokens per rank per step")
    head = (f"{'arm':>14} {'tok/s':>8} {'vs uni':>6} {'vs ep':>6} {'vs ds':>6} {'strag':>6} {'ep str':>6} "
            f"{'rep/l':>5} {'gath MB':>7} {'exposed':>7} {'a2a MB':>7} {'state MB':>8}")
    print(head)
    for arm, r in results.items():
        a2a = (r.get("a2a_bytes_intra", 0) + r.get("a2a_bytes_inter", 0)) / 2**20
        print(f"{arm:>14} {r['tokens_per_s']:>8.0f} {r.get('vs_uniform', float('nan')):>6.2f} "
              f"{r.get('vs_ep', float('nan')):>6.2f} {r.get('vs_deepspeed-moe', float('nan')):>6.2f} "
              f"{r.get('straggler', float('nan')):>6.2f} {r.get('ep_straggler', float('nan')):>6.2f} "
              f"{r.get('replicas_per_layer', 0):>5.2f} {r.get('gather_bytes', 0) / 2**20:>7.2f} "
              f"{100 * r.get('exposed_share', 0):>6.1f}% "
              f"{a2a:>7.2f} {r['model_state_bytes']['total'] / 2**20:>8.2f}")


if __name__ == "__main__":
    main()

"""Hugging Face MoE families on FSSDP against static EP and plain DeepSpeed data parallelism.

    deepspeed --num_gpus 2 benchmarks/hf_models.py [--families mixtral,deepseek_v3,qwen3_moe,gpt_oss] [--json out.json]

For each family a tiny model (``ds_fssdp.integrations.hf_tiny``: the family's own router, shared
experts and activation) is built three times from the same seed: ``plain`` (the unconverted HF
model under ``deepspeed.initialize``: every expert data parallel), ``ep`` and ``fssdp`` (converted
with ``ds_fssdp.integrations.hf.convert``, through ``ds_fssdp.initialize`` with that policy). Data:
token ids drawn from a Zipf law, so the routers send most tokens to a few experts. SGD, so the
three arms train the same math and their losses agree to fp32 rounding (reported).

After ``--warmup`` steps the arms run in alternating order (A B C, then C B A, ...) for
``--rounds`` rounds of ``--steps`` steps; the time of each arm's steps is summed. Reported per
family and arm: tokens/s over all ranks, the ratio to ``plain``, the straggler factor (max / mean
rows per rank, mean over the timed steps; plain computes every expert locally, so it has none) and
the largest relative loss difference from ``plain`` over the steps all arms ran.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import deepspeed
import torch
from deepspeed import comm as dist

import ds_fssdp
import ds_fssdp.integrations.hf as fssdp_hf
from ds_fssdp.integrations.hf_tiny import TESTED_FAMILIES, tiny_config
from ds_fssdp.runtime.cpu import skip_shm_comm_build

ARMS = ("plain", "ep", "fssdp")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="mixtral,deepseek_v3,qwen3_moe,gpt_oss")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps per arm per round")
    p.add_argument("--json", default=None)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args, _ = p.parse_known_args()
    unknown = set(args.families.split(",")) - set(TESTED_FAMILIES)
    if unknown:
        p.error(f"--families: unknown {sorted(unknown)}; known: {', '.join(TESTED_FAMILIES)}")
    return args


def ds_config(args, world: int, policy: str | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
           "train_batch_size": args.micro_batch * world, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 1},
           "zero_allow_untested_optimizer": True}
    if policy is not None:
        cfg["fssdp"] = {"policy": policy, "materialization_budget": 2, "overlap_degree": 4}
    return cfg


def build(family: str, arm: str, args, world: int):
    import transformers
    torch.manual_seed(0)
    config = tiny_config(family, hidden=args.hidden, experts=args.experts, ffn=args.ffn, layers=args.layers, vocab=256,
                         router_aux_loss_coef=0.01)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if arm == "plain":
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(args, world, None))
    else:
        fssdp_hf.convert(model, route_initialize=False)
        engine, *_ = ds_fssdp.initialize(model=model, config=ds_config(args, world, arm))
    return engine, model


def batches(args, rank: int, n: int):
    gen = torch.Generator().manual_seed(1 + rank)
    probs = 1.0 / torch.arange(1, 254, dtype=torch.float).pow(args.zipf)
    for _ in range(n):
        ids = 3 + torch.multinomial(probs, args.micro_batch * args.seq_len, replacement=True, generator=gen)
        ids = ids.view(args.micro_batch, args.seq_len)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run_family(family: str, args, world: int, rank: int) -> dict:
    arms = {arm: build(family, arm, args, world) for arm in ARMS}
    total = args.warmup + args.rounds * args.steps
    data = {arm: list(batches(args, rank, total)) for arm in ARMS}  # the same batches for every arm
    done = {arm: 0 for arm in ARMS}
    losses = {arm: [] for arm in ARMS}
    seconds = {arm: 0.0 for arm in ARMS}
    straggler = {arm: [] for arm in ARMS}

    def run(arm, n, timed):
        engine, model = arms[arm]
        for _ in range(n):
            batch = data[arm][done[arm]]
            done[arm] += 1
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            dist.barrier()
            if timed:
                seconds[arm] += time.perf_counter() - t0
                if arm != "plain":
                    straggler[arm].append(sum(m.last_stats["straggler"] for _, m in fssdp_hf.converted_experts(model))
                                          / len(fssdp_hf.converted_experts(model)))
            losses[arm].append(loss.item())

    for arm in ARMS:
        run(arm, args.warmup, timed=False)
    order = list(ARMS)
    for r in range(args.rounds):
        for arm in (order if r % 2 == 0 else order[::-1]):
            run(arm, args.steps, timed=True)
    tokens = args.rounds * args.steps * args.micro_batch * args.seq_len * world
    out = {}
    for arm in ARMS:
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses[arm], losses["plain"]))
        out[arm] = {"tokens_per_s": tokens / seconds[arm], "seconds": seconds[arm],
                    "straggler": sum(straggler[arm]) / len(straggler[arm]) if straggler[arm] else None,
                    "max_rel_loss_diff_vs_plain": diff, "losses": losses[arm]}
    for arm in ARMS:
        out[arm]["speedup_vs_plain"] = out[arm]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    return out


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        skip_shm_comm_build()
    deepspeed.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {family: run_family(family, args, world, rank) for family in args.families.split(",")}
    if rank == 0:
        print(f"{'family':<12} {'arm':<6} {'tokens/s':>10} {'x plain':>8} {'straggler':>9} {'loss diff':>10}")
        for family, arms in results.items():
            for arm, r in arms.items():
                s = f"{r['straggler']:.3f}" if r["straggler"] is not None else "-"
                print(f"{family:<12} {arm:<6} {r['tokens_per_s']:>10.0f} {r['speedup_vs_plain']:>8.3f} {s:>9} "
                      f"{r['max_rel_loss_diff_vs_plain']:>10.1e}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": f"{platform.machine()} {os.cpu_count()} cores", "ranks": world,
                           "args": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}, f,
                          indent=1)


if __name__ == "__main__":
    main()

"""Train a byte-level GPT-MoE on CPython's standard library with FSSDP.

    deepspeed --num_gpus 2 examples/train_gpt_moe.py                      # FSSDP (the default config)
    deepspeed --num_gpus 2 examples/train_gpt_moe.py --policy ep          # static expert parallelism

On a CPU-only machine the ``deepspeed`` launcher starts the ranks as CPU processes (gloo). The
config is ``ds_configs/gpt_moe_fssdp.json`` (DeepSpeed's keys plus the ``"fssdp"`` section).
Rank 0 shows a progress bar (loss, tokens/s, straggler factor per MoE layer) and ends with a
summary table; ``--out DIR`` also writes it as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

import ds_fssdp
from ds_fssdp.data import load_corpus, sample_batch, split
from ds_fssdp.models import GPTMoE, GPTMoEConfig
from ds_fssdp.runtime.cpu import skip_shm_comm_build

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", default=os.path.join(REPO, "ds_configs", "gpt_moe_fssdp.json"))
    p.add_argument("--policy", choices=["fssdp", "ep"], help="override fssdp.policy of the config")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--ffn-hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="directory for summary.json (rank 0)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args, _ = p.parse_known_args()
    return args


def main():
    args = parse_args()
    if get_accelerator().device_name() == "cpu":
        skip_shm_comm_build()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", "1"))))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.policy:
        config.setdefault("fssdp", {})["policy"] = args.policy
    train_N, val_N = split(load_corpus())
    torch.manual_seed(args.seed)
    cfg = GPTMoEConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, num_experts=args.experts,
                       ffn_hidden=args.ffn_hidden)
    model = GPTMoE(cfg)
    engine, _, _, _ = ds_fssdp.initialize(model=model, config=config)
    device = engine.device
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    tokens_per_step = world * micro * gas * args.seq_len

    bar = None
    if rank == 0:
        from tqdm import tqdm
        policy = config.get("fssdp", {}).get("policy", "fssdp")
        bar = tqdm(total=args.steps, desc=f"{policy} {world} ranks", dynamic_ncols=True)
    history = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        losses = []
        for _ in range(gas):
            x, y = sample_batch(train_N, micro, args.seq_len, gen)
            loss = engine(x.to(device), y.to(device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        loss_t = torch.tensor(sum(losses) / len(losses))
        dist.all_reduce(loss_t)
        elapsed = time.perf_counter() - t0
        stats = [layer.last_stats for layer in model.moe_layers()]
        history.append({"loss": float(loss_t) / world, "seconds": elapsed, "layers": stats})
        if bar is not None:
            bar.update(1)
            straggler = "/".join(f"{s['straggler']:.2f}" for s in stats)
            bar.set_postfix_str(f"loss {history[-1]['loss']:.3f} | {tokens_per_step / elapsed:,.0f} tok/s | "
                                f"straggler {straggler}")
    if bar is not None:
        bar.close()

    val_loss = evaluate(engine, val_N, micro, args.seq_len, device)
    if rank == 0:
        summary = summarize(history, tokens_per_step, val_loss, world, config)
        print_table(summary)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)


@torch.no_grad()
def evaluate(engine, val_N, micro, seq_len, device, batches: int = 4) -> float:
    engine.eval()
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    total = 0.0
    for _ in range(batches):
        x, y = sample_batch(val_N, micro, seq_len, gen)
        total += engine(x.to(device), y.to(device)).item()
    engine.train()
    t = torch.tensor(total / batches)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def summarize(history, tokens_per_step, val_loss, world, config):
    warm = history[min(5, len(history) - 1):]  # skip start-up steps in the speed figures
    layers = len(history[-1]["layers"])
    mean = lambda xs: sum(xs) / max(1, len(xs))
    return {
        "policy": config.get("fssdp", {}).get("policy", "fssdp"),
        "ranks": world,
        "steps": len(history),
        "first_loss": history[0]["loss"],
        "final_loss": mean([h["loss"] for h in history[-10:]]),
        "val_loss": val_loss,
        "tokens_per_s": tokens_per_step * len(warm) / sum(h["seconds"] for h in warm),
        "layers": [{
            "straggler": mean([h["layers"][l]["straggler"] for h in warm]),
            "ep_straggler": mean([h["layers"][l]["ep_straggler"] for h in warm]),
            "replicas": mean([h["layers"][l]["replicas"] for h in warm]),
            "gather_MB": sum(h["layers"][l]["gather_bytes"] for h in history) / 2**20,
            "reduce_MB": sum(h["layers"][l]["reduce_bytes"] for h in history) / 2**20,
        } for l in range(layers)],
    }


def print_table(s):
    print(f"\n{s['policy']} on {s['ranks']} ranks, {s['steps']} steps: loss {s['first_loss']:.3f} -> "
          f"{s['final_loss']:.3f} (validation {s['val_loss']:.3f}), {s['tokens_per_s']:,.0f} tokens/s")
    print(f"{'layer':>5} {'straggler':>9} {'EP would be':>11} {'replicas':>8} {'gathered MB':>11} {'reduced MB':>10}")
    for i, l in enumerate(s["layers"]):
        print(f"{i:>5} {l['straggler']:>9.3f} {l['ep_straggler']:>11.3f} {l['replicas']:>8.2f} "
              f"{l['gather_MB']:>11.1f} {l['reduce_MB']:>10.1f}")


if __name__ == "__main__":
    main()

"""Memory per rank of LoRA fine-tuning on an MoE model: FSSDP (frozen experts sharded, LoRA factors
data parallel) against DeepSpeed ZeRO-3 + PEFT (everything partitioned).

    deepspeed --num_gpus 2 benchmarks/lora_memory.py [--family qwen3_moe] [--json out.json]

Both arms start from the same tiny model of the family (``hf_tiny``, sized by the flags) with the
same PEFT LoRA (experts' ``gate_up_proj`` and ``down_proj`` plus the attention projections), AdamW
(torch implementation), fp32:

* ``fssdp``: ``convert`` + ZeRO ``--fssdp-zero`` (default 1) through ``ds_fssdp.initialize``;
* ``zero3``: the unconverted model under plain DeepSpeed ZeRO 3.

Reported per rank (bytes): **model states** counted from the tensors each rank holds: parameters
(expert rows: ``engine.fssdp.state_bytes()``; ZeRO-3: the partitions), optimizer state (DeepSpeed's
fp32 partitions and the basic optimizer's moments), and **measured peak resident memory** over
``--steps`` training steps after one warm-up step (Linux: VmHWM reset through
``/proc/self/clear_refs``), with the resident memory before them, so the difference is what the
steps added (activations, gathered replicas or ZeRO-3 gathers). The arms run one after the
other (fssdp first), so the step time printed is indicative only (no alternation). On CPU the
resident numbers include the runtime and the allocator's retained pages; the model-state numbers
are exact.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import time

import deepspeed
import torch
from deepspeed import comm as dist

import ds_fssdp
import ds_fssdp.integrations.hf as fssdp_hf
from ds_fssdp.integrations.hf_tiny import TESTED_FAMILIES, tiny_config
from ds_fssdp.runtime.cpu import skip_shm_comm_build

ARMS = ("fssdp", "zero3")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_moe", choices=TESTED_FAMILIES)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fssdp-zero", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--json", default=None)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args, _ = p.parse_known_args()
    return args


def ds_config(args, world: int, arm: str) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "train_batch_size": args.micro_batch * world, "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 3 if arm == "zero3" else args.fssdp_zero},
            "fssdp": {"materialization_budget": 2, "overlap_degree": 4}}


def build(args, arm: str, world: int):
    import transformers
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    config = tiny_config(args.family, hidden=args.hidden, ffn=args.ffn, experts=args.experts, layers=args.layers,
                         vocab=512, max_position_embeddings=args.seq_len)
    model = transformers.AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=ATTENTION,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    if arm == "fssdp":
        model = get_peft_model(fssdp_hf.convert(model, route_initialize=False), lora)
        init = ds_fssdp.initialize
    else:
        model = get_peft_model(model, lora)
        init = deepspeed.initialize
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = init(model=model, model_parameters=params, config=ds_config(args, world, arm))
    return engine


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def model_states(engine, arm: str) -> dict:
    """Bytes of parameters and optimizer state this rank holds."""
    params = 0
    for p in engine.module.parameters():
        params += nbytes(p.ds_tensor) if hasattr(p, "ds_tensor") else nbytes(p)
    experts = engine.fssdp.state_bytes()["expert_total"] if arm == "fssdp" else 0
    opt, seen = 0, set()
    tensors = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        tensors += list(getattr(engine.optimizer, name, []) or [])
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in basic.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            opt += nbytes(t)
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad and not hasattr(p, "ds_tensor"))
    trainable += sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad and hasattr(p, "ds_numel"))
    return {"dense_params": params, "expert_params": experts, "optimizer": opt,
            "model_states": params + experts + opt, "trainable_params": trainable}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def batch(args, rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    probs = torch.arange(509, 0, -1, dtype=torch.float).pow(1.2)
    ids = 3 + torch.multinomial(probs, args.micro_batch * args.seq_len, replacement=True, generator=gen)
    ids = ids.view(args.micro_batch, args.seq_len)
    return {"input_ids": ids, "labels": ids}


def run_arm(args, arm: str, world: int, rank: int) -> dict:
    gc.collect()
    engine = build(args, arm, world)
    states = model_states(engine, arm)

    def step(i):
        loss = engine(**batch(args, rank, i)).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    step(0)  # warm-up: the optimizer state exists from here
    gc.collect()
    dist.barrier()
    reset_peak()
    before = _status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    losses = [step(i) for i in range(1, args.steps + 1)]
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM") * 1024
    replica_peak = max((m.last_stats.get("replica_bytes_peak", 0) for _, m in fssdp_hf.converted_experts(
        engine.module)), default=0)
    out = dict(states, rss_before_steps=before, peak_rss_steps=peak, added_by_steps=peak - before,
               step_s=seconds / args.steps, losses=losses, replica_bytes_peak=replica_peak)
    del engine
    gc.collect()
    return out


def main():
    args = parse_args()
    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for arm in ARMS:  # one pass each: the peaks are reset per arm
        results[arm] = run_arm(args, arm, world, rank)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        report = {"machine": platform.processor() or platform.machine(), "world": world, "args": vars(args),
                  "per_rank": gathered}
        keys = ("dense_params", "expert_params", "optimizer", "model_states", "peak_rss_steps", "added_by_steps")
        print(f"{'rank':>4} {'arm':>6} " + " ".join(f"{k:>15}" for k in keys) + f" {'step_s':>8}")
        for r, res in enumerate(gathered):
            for arm in ARMS:
                print(f"{r:>4} {arm:>6} " + " ".join(f"{res[arm][k] / 2**20:>13.2f}MB" for k in keys) +
                      f" {res[arm]['step_s']:>8.3f}")
        ratio = {k: [res["fssdp"][k] / res["zero3"][k] for res in gathered] for k in keys if all(
            res["zero3"][k] for res in gathered)}
        report["fssdp_over_zero3"] = ratio
        print("fssdp / zero3 per rank: " + ", ".join(f"{k} {[round(v, 3) for v in vs]}" for k, vs in ratio.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

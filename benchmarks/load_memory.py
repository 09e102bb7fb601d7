"""Peak host memory per rank of loading and exporting a big MoE model: FSSDP's loader and writer
against today's path and against Hugging Face's ZeRO-3 load.

    python benchmarks/load_memory.py [--worlds 1,2,4] [--layers 4] [--experts 32] [--json out.json]

A Qwen3-MoE checkpoint is written by transformers itself (per-expert keys, ``--shard`` shards;
``--layers`` x ``--experts`` experts of H ``--hidden`` and I ``--ffn``, fp32), then for every world
size D and arm, D gloo ranks in fresh processes (``spawn``): each loads a small model of the same
family through the arm first (imports, first engine), then measures the rise of its peak resident
memory (VmHWM, reset through /proc/self/clear_refs after a malloc_trim; file-backed pages count)
during the arm's load (+ initialize) and during its export:

* ``fssdp``: ``integrations.hf.from_pretrained`` + ``ds_fssdp.initialize`` (ZeRO 1); export
  ``integrations.hf.save_pretrained``;
* ``convert`` (today's path): ``AutoModelForCausalLM.from_pretrained`` + ``convert`` +
  ``ds_fssdp.initialize``; export ``hf_state_dict`` (collective) + ``save_pretrained`` on rank 0;
* ``hf_zero3`` (the anchor): transformers' ZeRO-3 load (``HfDeepSpeedConfig``: built under
  ``zero.Init``, rank 0 reads) + plain ``deepspeed.initialize`` (ZeRO 3, every expert data
  parallel); export DeepSpeed's 16-bit consolidation + ``save_pretrained`` on rank 0.

Reported per arm and D: every rank's rises (MiB) and their maximum; per arm the least-squares fit
of the load rise against experts / D over the world sizes (``load_per_expert_byte_held``: 1.0 when
a rank's peak grows by exactly the experts it holds, 1/D of them, plus ``load_fixed_mib``; today's
path holds every expert at any D, so its peak does not follow experts / D at all). ``--recipe`` adds the per-rank memory the
formula gives for Qwen3-30B-A3B on 8 GPUs (load, training, export), as in the README. The machine
and the command go into the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time

ARMS = ("fssdp", "convert", "hf_zero3")
MiB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,4", help="world sizes D")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=640)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--shard", default="32MB", help="max_shard_size of the checkpoint and the exports")
    p.add_argument("--recipe", action="store_true", help="add the formula's numbers for Qwen3-30B-A3B on 8 GPUs")
    p.add_argument("--dir", default=None, help="where the checkpoint and the exports go (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here ('-': stdout, and nothing else there)")
    args = p.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        p.error(f"--arms: unknown {sorted(unknown)}; known: {', '.join(ARMS)}")
    return args


# -- per rank -----------------------------------------------------------------------------------
def ds_config(arm: str, world: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**9, "zero_optimization": {"stage": 1}}
    if arm == "hf_zero3":
        cfg["zero_optimization"] = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    else:
        cfg["fssdp"] = {"policy": "fssdp", "materialization_budget": 2, "metrics_csv": None}
    return cfg


def run_arm(arm: str, path: str, out_dir: str, world: int, shard: str) -> tuple:
    """Load (+ initialize) and export ``path`` through ``arm``; returns (load, export) PeakRise."""
    import torch
    import transformers
    from deepspeed import comm as dist

    import ds_fssdp
    import ds_fssdp.integrations.hf as fssdp_hf
    from ds_fssdp.runtime.engine import _deepspeed_initialize
    from ds_fssdp.runtime.host_memory import PeakRise
    cfg = ds_config(arm, world)
    rank = dist.get_rank()
    keep = None
    with PeakRise() as load:
        if arm == "fssdp":
            model = fssdp_hf.from_pretrained(path, ds_config=cfg, dtype=torch.float32)
            engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
        elif arm == "convert":
            model = fssdp_hf.convert(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                     route_initialize=False)
            engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
        else:
            from transformers.integrations import HfDeepSpeedConfig
            keep = HfDeepSpeedConfig(cfg)  # transformers builds under zero.Init while it is alive
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            engine, *_ = _deepspeed_initialize(model=model, config=cfg)
    with PeakRise() as export:
        if arm == "fssdp":
            fssdp_hf.save_pretrained(model, out_dir, max_shard_size=shard)
        else:
            state = (fssdp_hf.hf_state_dict(model) if arm == "convert"
                     else engine._zero3_consolidated_16bit_state_dict())
            if rank == 0:
                transformers.PreTrainedModel.save_pretrained(model, out_dir, state_dict=state, max_shard_size=shard)
            del state
            dist.barrier()
    del engine, model, keep
    if arm == "hf_zero3":
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
    return load, export


def _rank(rank: int, world: int, port: int, arm: str, paths: dict, result: str) -> None:
    os.dup2(2, 1)  # DeepSpeed's and transformers' messages: stdout stays the JSON's (--json -)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    from ds_fssdp.runtime.elastic import destroy_process_group, init_distributed
    init_distributed(backend="gloo")
    from deepspeed import comm as dist
    run_arm(arm, paths["small"], os.path.join(paths["root"], f"warm-{arm}-{world}"), world, paths["shard"])
    dist.barrier()
    load, export = run_arm(arm, paths["big"], os.path.join(paths["root"], f"out-{arm}-{world}"), world,
                           paths["shard"])
    with open(f"{result}.{rank}", "w") as f:
        json.dump({"load_rise_mib": load.rise / MiB, "export_rise_mib": export.rise / MiB, "load_s": load.seconds,
                   "export_s": export.seconds}, f)
    dist.barrier()
    destroy_process_group()


# -- the run ------------------------------------------------------------------------------------
def checkpoint(path: str, args, *, hidden: int, ffn: int) -> dict:
    """Write the Qwen3-MoE checkpoint; returns its dense and expert bytes."""
    import torch
    import transformers
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=args.vocab, hidden_size=hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, num_experts=args.experts, moe_intermediate_size=ffn,
        intermediate_size=2 * ffn, num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.02,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size=args.shard)
    from ds_fssdp.integrations.safetensors_io import read_header
    sizes = {"dense": 0, "experts": 0}
    for n in os.listdir(path):
        if n.endswith(".safetensors"):
            for key, e in read_header(os.path.join(path, n))[0].items():
                sizes["experts" if ".experts." in key else "dense"] += e.nbytes
    return sizes


def spawn(world: int, arm: str, paths: dict) -> list:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = os.path.join(paths["root"], f"result-{arm}-{world}")
    mp.start_processes(_rank, args=(world, port, arm, paths, result), nprocs=world, join=True, start_method="spawn")
    out = []
    for r in range(world):
        with open(f"{result}.{r}") as f:
            out.append(json.load(f))
    return out


def recipe() -> dict:
    """Per-rank memory the formula gives for Qwen3-30B-A3B (bf16; 48 layers of 128 experts, H 2048,
    I 768; dense: embeddings and head 2 x 151936 x 2048, attention 48 x (2 x 2048 x 4096 + 2 x 2048 x
    512), routers 48 x 128 x 2048) on 8 GPUs as one FSSDP group, ZeRO 1, Adam: model states as
    ``sim/memory.py`` counts them (bf16 parameter and gradient, 12 bytes of optimizer state)."""
    from ds_fssdp.sim.setup import GRAD_BYTES, OPT_BYTES, PARAM_BYTES
    D, L, E, H, I = 8, 48, 128, 2048, 768
    expert = 3 * H * I
    experts = L * E * expert
    dense = 2 * 151936 * H + L * (2 * H * 4096 + 2 * H * 512) + L * E * H
    own = experts // D
    layer_own = own // L
    GB = 1e9
    return {
        "model": {"params_B": (experts + dense) / 1e9, "bf16_GB": (experts + dense) * PARAM_BYTES / GB,
                  "experts_bf16_GB": experts * PARAM_BYTES / GB, "dense_bf16_GB": dense * PARAM_BYTES / GB},
        "load_host_GB": {"fssdp": (dense + 2 * layer_own) * PARAM_BYTES / GB,
                         # the whole model, and convert's copy of the experts, 2-3 layers at a time
                         "convert (today)": (experts + dense + 3 * E * expert) * PARAM_BYTES / GB},
        "load_device_GB": {"fssdp": own * PARAM_BYTES / GB},
        "train_device_GB": {"fssdp model states": ((PARAM_BYTES + GRAD_BYTES) * (dense + own)
                                                    + OPT_BYTES * (dense / D + own)) / GB},
        "export_host_GB": {"fssdp rank 0": (dense + 2 * layer_own) * PARAM_BYTES / GB,
                           "fssdp other ranks": 2 * layer_own * PARAM_BYTES / GB,
                           "convert (today), every rank": ((experts + dense) * PARAM_BYTES + E * expert * 4) / GB},
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    quiet = args.json == "-"
    log = sys.stderr if quiet else sys.stdout
    worlds = [int(w) for w in args.worlds.split(",")]
    arms = args.arms.split(",")
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        stdout, sys.stdout = sys.stdout, sys.stderr  # DeepSpeed's import warning goes to stdout
        try:
            sizes = checkpoint(os.path.join(root, "big"), args, hidden=args.hidden, ffn=args.ffn)
            checkpoint(os.path.join(root, "small"), args, hidden=32, ffn=24)
        finally:
            sys.stdout = stdout
        paths = {"big": os.path.join(root, "big"), "small": os.path.join(root, "small"), "root": root,
                 "shard": args.shard}
        runs = []
        for world in worlds:
            for arm in arms:
                t0 = time.perf_counter()
                ranks = spawn(world, arm, paths)
                runs.append({"world": world, "arm": arm, "ranks": ranks, "wall_s": time.perf_counter() - t0})
                print(f"D={world} {arm:>8}: load rise {max(r['load_rise_mib'] for r in ranks):8.1f} MiB, export "
                      f"rise {max(r['export_rise_mib'] for r in ranks):8.1f} MiB (max over ranks)", file=log)
    summary = {}
    for run in runs:
        s = summary.setdefault(run["arm"], {})
        load = max(r["load_rise_mib"] for r in run["ranks"])
        s[run["world"]] = {"load_rise_mib": load, "export_rise_mib": max(r["export_rise_mib"] for r in run["ranks"])}
    fits = {}
    for arm, by_world in summary.items():
        if len(by_world) >= 2:  # rise = a + b * experts / D, least squares over the world sizes
            xs = [sizes["experts"] / MiB / w for w in by_world]
            ys = [v["load_rise_mib"] for v in by_world.values()]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            fits[arm] = {"load_per_expert_byte_held": b, "load_fixed_mib": my - b * mx}
    out = {"command": " ".join(["python", "benchmarks/load_memory.py"] + (argv or sys.argv[1:])),
           "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version()},
           "model": {"family": "qwen3_moe", "layers": args.layers, "experts": args.experts, "hidden": args.hidden,
                     "ffn": args.ffn, "vocab": args.vocab, "dtype": "float32", "dense_mib": sizes["dense"] / MiB,
                     "experts_mib": sizes["experts"] / MiB, "shard": args.shard},
           "runs": runs, "summary": summary, "fit_load_vs_experts_over_D": fits}
    if args.recipe:
        out["recipe_qwen3_30b_a3b_8gpus"] = recipe()
    text = json.dumps(out, indent=1)
    if args.json == "-":
        print(text)
    elif args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

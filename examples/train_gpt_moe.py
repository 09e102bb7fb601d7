"""Train a byte-level GPT-MoE on CPython's standard library with FSSDP.

    deepspeed --num_gpus 2 examples/train_gpt_moe.py                      # FSSDP (the default config)
    deepspeed --num_gpus 2 examples/train_gpt_moe.py --policy ep          # static expert parallelism

On a CPU-only machine the ``deepspeed`` launcher starts the ranks as CPU processes (gloo). The
config is ``ds_configs/gpt_moe_fssdp.json`` (DeepSpeed's keys plus the ``"fssdp"`` section).
Rank 0 shows a progress bar (loss, tokens/s, straggler factor per MoE layer) and ends with a
table (loss, tokens/s, straggler factor and bytes moved per layer). Everything goes into the run
directory (``--out``, default ``runs/gpt_moe_<policy>``):

    summary.json        the closing table's numbers
    metrics.csv         per optimizer step, per layer: straggler, replicas, bytes, exposed time, ...
    trace.npz/.json     every iteration's routing counts tokens_ED (docs/traces.md)
    load_heatmap.png    expert share of tokens over iterations per layer
    placement.png       owners and replicas per rank, rows per rank against static EP
    metrics.png         the CSV over steps

Run it once per policy and the second run's table ends with a comparison to the first.

Pipeline parallelism (docs/design.md, section 9):

    deepspeed --num_gpus 4 examples/train_gpt_moe.py --pipeline-stages 2

cuts the model into 2 stages (DeepSpeed's ``PipelineModule``, 1F1B) with FSSDP inside each stage's
data-parallel ranks. It trains on the same global batches as the run without pipelining on the
same ranks (each of the world / S pipelines takes the micro-batches of S ranks: S times the
gradient accumulation steps), so its ``losses.jsonl`` matches that run's (the loss includes the
routers' auxiliary terms either way). Stages need not be even (``--layers 3`` on 2 stages, or
``--layers 8 --stage-layers 3,5``). The
per-layer table and the metrics CSV list every stage's layers; each stage's first rank writes its
layers' trace (``trace.npz`` from the stage holding MoE layer 0, ``trace.stage<s>.npz`` from the
others), and the pictures show ``trace.npz``'s layers.

Checkpoints and restarts (docs/robustness.md):

    torchrun --nproc_per_node 4 --max-restarts 3 examples/train_gpt_moe.py --save-dir ckpt --save-interval 50

saves every 50 steps and at the end (``--keep-last K`` keeps the K newest), and on start resumes
from the newest complete checkpoint in ``--save-dir`` (also on another world size), the data
stream at the exact next batch. SIGTERM or SIGUSR1 (preemption) finishes the current step, saves
and exits 0 (``--preempt-grace S`` bounds the time, ``--no-preempt-handler`` turns it off).
``--resume latest-valid`` falls back to an older checkpoint when the newest fails its checks.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

import ds_fssdp
from ds_fssdp.runtime import resume_cli
from ds_fssdp.config import POLICIES
from ds_fssdp.data import load_corpus, sample_batch, split
from ds_fssdp.data.sampler import WindowSampler
from ds_fssdp.runtime.checkpoint import CheckpointError
from ds_fssdp.models import GPTMoE, GPTMoEConfig, GPTMoEPipe
from ds_fssdp.models.gpt_moe import CHECKPOINTING
from ds_fssdp.runtime.cpu import skip_shm_comm_build

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", default=os.path.join(REPO, "ds_configs", "gpt_moe_fssdp.json"))
    p.add_argument("--policy", choices=POLICIES, help="override fssdp.policy of the config")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--ffn-hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--activation-checkpointing", choices=tuple(CHECKPOINTING), default="none",
                   help="the blocks' activation checkpointing (GPTMoEConfig.activation_checkpointing)")
    p.add_argument("--pipeline-stages", type=int, default=1,
                   help="pipeline stages (DeepSpeed's PipelineModule); must divide the number of ranks")
    p.add_argument("--stage-layers", default=None,
                   help="MoE blocks per pipeline stage, comma-separated (e.g. 3,5 for --layers 8 on 2 stages; the "
                        "embedding goes with stage 0, the head with the last); default: balanced")
    p.add_argument("--out", default=None, help="run directory (default: runs/gpt_moe_<policy>)")
    p.add_argument("--no-report", action="store_true", help="skip the PNGs")
    resume_cli.add_arguments(p)  # --save-dir, --save-interval, --keep-last, --resume, preemption
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = p.parse_args()  # unknown flags are errors; the deepspeed launcher's --local_rank is declared above
    resume_cli.check_arguments(p, args)
    if args.pipeline_stages < 1:
        p.error(f"--pipeline-stages ({args.pipeline_stages}) must be >= 1")
    args.parts = None
    if args.stage_layers is not None:
        args.parts = stage_parts(p, args.stage_layers, stages=args.pipeline_stages, layers=args.layers)
    return args


def stage_parts(p, text: str, *, stages: int, layers: int) -> list:
    """``--stage-layers`` as GPTMoEPipe's stage boundaries (refused by name when it does not fit)."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        p.error(f"--stage-layers ({text}) must be comma-separated integers")
    if stages < 2 or len(counts) != stages or sum(counts) != layers or min(counts) < 0:
        p.error(f"--stage-layers ({text}) must give each of the {stages} pipeline stages (--pipeline-stages, >= 2) a "
                f"number of MoE blocks >= 0, {layers} in all (--layers)")
    parts, edge = [0], 1  # the embedding
    for n in counts[:-1]:
        edge += n
        parts.append(edge)
    return parts + [layers + 2]  # the head


def main():
    args = parse_args()
    t_start = time.perf_counter()
    if get_accelerator().device_name() == "cpu":
        skip_shm_comm_build()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", "1"))))
    ds_fssdp.init_distributed()  # restart-safe under torchrun --max-restarts
    rank, world = dist.get_rank(), dist.get_world_size()
    stages = args.pipeline_stages
    if world % stages:
        raise SystemExit(f"--pipeline-stages ({stages}) must divide the number of ranks ({world})")

    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if stages > 1:  # world / S pipelines of S ranks' micro-batches each: the same global batch
        config["gradient_accumulation_steps"] = config.get("gradient_accumulation_steps", 1) * stages
    fssdp_cfg = config.setdefault("fssdp", {})
    if args.policy:
        fssdp_cfg["policy"] = args.policy
    policy = fssdp_cfg.get("policy", "fssdp")
    out = args.out or os.path.join("runs", f"gpt_moe_{policy}")
    fssdp_cfg["trace_path"] = os.path.join(out, "trace.npz")
    fssdp_cfg["metrics_csv"] = os.path.join(out, "metrics.csv")

    train_N, val_N = split(load_corpus())
    torch.manual_seed(args.seed)
    cfg = GPTMoEConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, num_experts=args.experts,
                       ffn_hidden=args.ffn_hidden, activation_checkpointing=args.activation_checkpointing)
    model = GPTMoE(cfg)
    if stages > 1:  # the same weights, cut into stages
        model = GPTMoEPipe(model, num_stages=stages, parts=args.parts)
    engine, _, _, _ = ds_fssdp.initialize(model=model, config=config)
    device = engine.device
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps() // stages
    sampler = WindowSampler(train_N, args.seq_len, seed=args.seed + 1)
    tokens_per_step = world * micro * gas * args.seq_len
    topology = engine.fssdp.topology
    start = 0
    if args.save_dir and args.resume != "none":
        start = ds_fssdp.resume(engine, args.save_dir, state={"sampler": sampler}, which=args.resume)
        if rank == 0 and start:
            print(f"resumed at step {start} from {args.save_dir}", flush=True)
    preemption = None if args.no_preempt_handler else ds_fssdp.Preemption(grace_s=args.preempt_grace,
                                                                          device=device).install()
    # Interval saves may go to the background (--async-save); the last one and a preemption's are
    # synchronous, so the job never exits with a checkpoint still being written.
    save = lambda step, background=False: ds_fssdp.save_step(engine, args.save_dir, step, state={"sampler": sampler},
                                                             keep_last=args.keep_last, async_save=background)

    bar = None
    if rank == 0:
        from tqdm import tqdm
        nodes = f" in {topology.num_nodes} nodes" if topology.num_nodes > 1 else ""
        bar = tqdm(total=args.steps, initial=start, desc=f"{policy} {world} ranks{nodes}", dynamic_ncols=True)
        keep_losses(os.path.join(out, "losses.jsonl"), upto=start)
    history, preempted = [], None
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        if stages > 1:
            mean_loss = train_pipelined(engine, sampler, micro=micro, gas=gas, stages=stages, device=device)
        else:
            losses = []
            for _ in range(gas):
                x, y = sampler.next_batch(micro, rank=rank, world=world)
                loss = engine(x.to(device), y.to(device))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            loss_t = torch.tensor(sum(losses) / len(losses))
            dist.all_reduce(loss_t)
            mean_loss = float(loss_t) / world
        elapsed = time.perf_counter() - t0
        stats = layer_stats(engine)
        history.append({"step": step + 1, "loss": mean_loss, "seconds": elapsed, "layers": stats})
        if rank == 0:
            with open(os.path.join(out, "losses.jsonl"), "a") as f:  # every step, also of runs that die
                f.write(json.dumps({"step": step + 1, "loss": history[-1]["loss"]}) + "\n")
        if bar is not None:
            bar.update(1)
            straggler = "/".join(f"{s['straggler']:.2f}" for s in stats)
            bar.set_postfix_str(f"loss {history[-1]['loss']:.3f} | {tokens_per_step / elapsed:,.0f} tok/s | "
                                f"straggler {straggler}")
        if preemption is not None and preemption.stop_now():
            preempted = step + 1
            if args.save_dir:
                save(preempted)
            break
        if args.save_dir and (step + 1 == args.steps or args.save_interval and (step + 1) % args.save_interval == 0):
            try:
                save(step + 1, background=args.async_save and step + 1 < args.steps)
            except CheckpointError as err:  # a full disk: every rank got it; the previous checkpoint stands
                if step + 1 == args.steps:
                    raise
                if rank == 0:
                    print(f"checkpoint at step {step + 1} failed, training goes on: {err}", flush=True)
    if bar is not None:
        bar.close()
    if preemption is not None:
        preemption.uninstall()
    if preempted is not None or not history:
        if rank == 0:
            print(f"preempted: stopped after step {preempted}" + (f", saved in {args.save_dir}" if args.save_dir
                                                                  else " (no --save-dir: nothing saved)")
                  if preempted is not None else f"nothing to do: resumed at step {start} of {args.steps}")
        engine.fssdp.close()
        engine.fssdp_monitor.close()
        engine.wait_for_checkpoint()  # a background save is committed before the process leaves
        ds_fssdp.destroy_process_group()
        return

    val_loss = evaluate(engine, val_N, micro, args.seq_len, device, stages=stages)
    engine.fssdp.close()  # the trace on disk is complete before the report reads it
    engine.fssdp_monitor.close()
    if rank == 0:
        summary = summarize(history, tokens_per_step, val_loss, world, config)
        summary.update(nodes=topology.num_nodes, ranks_per_node=topology.ranks_per_node, run_dir=out,
                       start_step=start, pipeline_stages=stages)
        files = []
        if not args.no_report:
            from ds_fssdp.report import render
            files = render(out)["files"]
        summary["wall_s"] = time.perf_counter() - t_start
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print_table(summary)
        print(f"run directory {out}: summary.json, metrics.csv, trace.npz" +
              "".join(f", {os.path.basename(p)}" for p in files))
        print_comparison(summary, out)
    engine.wait_for_checkpoint()  # a background save is committed before the process leaves
    ds_fssdp.destroy_process_group()  # an exit without it can abort in gloo's threads


def keep_losses(path: str, *, upto: int) -> None:
    """The per-step loss log keeps the steps before ``upto`` (those of the run resumed from)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = []
    if upto and os.path.isfile(path):
        with open(path) as f:
            lines = [line for line in f if line.strip() and json.loads(line)["step"] <= upto]
    with open(path, "w") as f:
        f.writelines(lines)


def train_pipelined(engine, sampler, *, micro: int, gas: int, stages: int, device) -> float:
    """One step of the pipeline engine on the same global batch as without pipelining: pipeline d
    takes, micro-step by micro-step, the micro-batches of ranks d * S .. d * S + S - 1. Every rank
    draws them (the sampler's position stays the same everywhere); the first and last stages use
    them. Returns the loss averaged over the global batch (auxiliary terms included)."""
    d = engine.grid.get_data_parallel_id()
    ranks = [d * stages + i for i in range(stages)]
    batches = [(x.to(device), y.to(device)) for _ in range(gas)
               for x, y in sampler.next_batches(micro, ranks=ranks, world=dist.get_world_size())]
    return float(engine.train_batch(data_iter=iter(batches)))


def layer_stats(engine) -> list:
    """Every MoE layer's statistics of the last step, in model order (under pipeline parallelism
    gathered from each stage's first rank: collective)."""
    stage = engine.fssdp
    mine = [layer.last_stats for layer in stage.layers]
    if stage.layout is None:
        return mine
    first = engine.grid.get_data_parallel_id() == 0
    parts = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(parts, (stage.global_layers, mine) if first else ([], []))
    by_layer = {g: s for indices, stats in parts for g, s in zip(indices, stats)}
    return [by_layer[g] for g in range(len(by_layer))]


@torch.no_grad()
def evaluate(engine, val_N, micro, seq_len, device, batches: int = 4, stages: int = 1) -> float:
    """The validation loss of each rank's ``batches`` micro-batches, averaged over the ranks (under
    pipeline parallelism pipeline d evaluates ranks d * S .. d * S + S - 1's)."""
    if stages > 1:
        d = engine.grid.get_data_parallel_id()
        data = []
        for r in range(d * stages, (d + 1) * stages):
            gen = torch.Generator().manual_seed(7 + r)
            data += [tuple(t.to(device) for t in sample_batch(val_N, micro, seq_len, gen)) for _ in range(batches)]
        return float(engine.eval_batch(iter(data), num_micro_batches=len(data)))
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
    nanmean = lambda xs: mean([x for x in xs if not math.isnan(x)]) if any(not math.isnan(x) for x in xs) else None
    mib = lambda key, l: sum(h["layers"][l].get(key, 0) for h in history) / 2**20
    return {
        "policy": config.get("fssdp", {}).get("policy", "fssdp"),
        "ranks": world,
        "pipeline_stages": 1,
        "steps": len(history),
        "first_loss": history[0]["loss"],
        "final_loss": mean([h["loss"] for h in history[-10:]]),
        "val_loss": val_loss,
        "tokens_per_s": tokens_per_step * len(warm) / sum(h["seconds"] for h in warm),
        "layers": [{
            "straggler": mean([h["layers"][l]["straggler"] for h in warm]),
            "ep_straggler": mean([h["layers"][l]["ep_straggler"] for h in warm]),
            "replicas": mean([h["layers"][l]["replicas"] for h in warm]),
            "gather_MB": mib("gather_bytes", l),
            "reduce_MB": mib("reduce_bytes", l),
            "gather_inter_MB": mib("gather_bytes_inter", l),
            "a2a_MB": mib("a2a_bytes_intra", l) + mib("a2a_bytes_inter", l),
            "exposed_ms": 1e3 * mean([h["layers"][l].get("gather_exposed_s", 0.0) +
                                      h["layers"][l].get("reduce_exposed_s", 0.0) for h in warm]),
            "prediction_error": nanmean([h["layers"][l].get("load_prediction_error", math.nan) for h in history]),
        } for l in range(layers)],
    }


def print_table(s):
    nodes = f" in {s['nodes']} nodes" if s.get("nodes", 1) > 1 else ""
    print(f"\n{s['policy']} on {s['ranks']} ranks{nodes}, {s['steps']} steps in {s['wall_s']:.0f} s: loss "
          f"{s['first_loss']:.3f} -> {s['final_loss']:.3f} (validation {s['val_loss']:.3f}), "
          f"{s['tokens_per_s']:,.0f} tokens/s")
    print(f"{'layer':>5} {'straggler':>9} {'EP would be':>11} {'replicas':>8} {'gathered MB':>11} {'reduced MB':>10} "
          f"{'inter-node MB':>13} {'tokens MB':>9} {'exposed ms':>10} {'pred. err':>9}")
    for i, l in enumerate(s["layers"]):
        err = "-" if l["prediction_error"] is None else f"{l['prediction_error']:.3f}"
        print(f"{i:>5} {l['straggler']:>9.3f} {l['ep_straggler']:>11.3f} {l['replicas']:>8.2f} "
              f"{l['gather_MB']:>11.1f} {l['reduce_MB']:>10.1f} {l['gather_inter_MB']:>13.1f} {l['a2a_MB']:>9.1f} "
              f"{l['exposed_ms']:>10.2f} {err:>9}")
    print("straggler: max/mean rows computed per rank (1 = balanced), mean over steps after 5; EP would be: the "
          "same with owners only; MB: whole run, all ranks; tokens MB: token all-to-all; exposed ms: rank 0's "
          "(with pipeline stages each stage's first rank's) wait for replicas and reduced gradients per step; "
          "pred. err: sum|predicted - actual| / sum actual")


def print_comparison(s, out):
    """The other policies' runs beside this one (``runs/gpt_moe_*``), if they were run."""
    others = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(out)), "*", "summary.json"))):
        if os.path.dirname(path) == os.path.abspath(out):
            continue
        with open(path) as f:
            other = json.load(f)
        if other.get("ranks") == s["ranks"] and other.get("steps") == s["steps"]:
            others.append((os.path.dirname(path), other))
    if not others:
        return
    strag = lambda r: sum(l["straggler"] for l in r["layers"]) / len(r["layers"])
    moved = lambda r: sum(l["gather_MB"] + l["reduce_MB"] for l in r["layers"])
    print(f"\n{'run':<28} {'policy':<9} {'tokens/s':>9} {'vs this':>7} {'final loss':>10} {'val loss':>8} "
          f"{'straggler':>9} {'replica MB':>10}")
    for path, r in [(os.path.abspath(out), s)] + others:
        print(f"{os.path.relpath(path):<28} {r['policy']:<9} {r['tokens_per_s']:>9,.0f} "
              f"{r['tokens_per_s'] / s['tokens_per_s']:>6.2f}x {r['final_loss']:>10.3f} {r['val_loss']:>8.3f} "
              f"{strag(r):>9.3f} {moved(r):>10.1f}")


if __name__ == "__main__":
    main()
    # Done: every file is written and closed, a background save committed, the process group torn
    # down. Leave without the interpreter's native teardown, where a gloo worker thread can still
    # abort the process after training ended ("terminate called without an active exception",
    # exit -6 under torchrun: seen in a clean-clone CI run of the restart test's reference run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

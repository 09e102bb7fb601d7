"""Shared pieces of the pipeline-parallel equivalence tests: the tiny GPT-MoE cut into stages, the
worker that trains it with DeepSpeed's pipeline engine through ds_fssdp.initialize, and the
single-process reference with its pre-step gradients.

Legend: S stages, dp data-parallel ranks per stage, G micro-batches per step."""
from __future__ import annotations

import copy
import dataclasses

import torch

from training import batch, ds_config, layer_tensors, model_for

STAGES = 2


def pp_config(*, dp=2, gas=4, zero=0, optimizer=None, clip=0.3, fssdp=None, pipeline=None, model=None):
    """``training.ds_config`` with ``dp`` pipelines (its world) and DeepSpeed's ``pipeline`` section."""
    cfg = ds_config(world=dp, zero=zero, gas=gas, optimizer=optimizer, clip=clip, fssdp=fssdp)
    if pipeline:
        cfg["pipeline"] = dict(pipeline)
    if model:
        cfg["_model"] = dict(model)  # GPTMoEConfig overrides (the test's key, not DeepSpeed's)
    return cfg


def data(step: int, gas: int, dp_rank: int):
    """Pipeline ``dp_rank``'s micro-batches of ``step``: rank ``dp_rank``'s of the data-parallel run."""
    return iter([batch(step, micro, dp_rank) for micro in range(gas)])


def build(cfg: dict, *, stages: int = STAGES):
    """The GPT-MoE of ``cfg`` (seeded as the reference's) and its pipeline module."""
    from ds_fssdp.models import GPTMoEPipe
    torch.manual_seed(0)
    model = model_for(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    pipe = GPTMoEPipe(model, num_stages=stages, parts=cfg.get("_parts"))
    # This stage's parameter names -> GPTMoE's (the reference's keys).
    pipe.model_names = {n: names[id(p)] for n, p in pipe.named_parameters()}
    return model, pipe


def ds_part(cfg: dict) -> dict:
    out = copy.deepcopy(cfg)
    for key in ("_model", "_parts"):
        out.pop(key, None)
    return out


def _capture_before_step(engine, into: list) -> None:
    """After the stage's before_step (expert gradients reduced and scaled, norm armed) and DeepSpeed's
    ReduceGrads: this stage's dense gradients (ZeRO 0 keeps them in .grad) and each owned expert's
    fp32 gradient row (replicated expert state)."""
    stage, names = engine.fssdp, engine.module.model_names
    original = stage.before_step

    def before_step(eng):
        original(eng)
        dense = {names[n]: p.grad.detach().float().clone() for n, p in eng.module.named_parameters()
                 if p.grad is not None}
        experts = {}
        if not stage.expert_state.partitioned:
            for g, shard in zip(stage.global_layers, stage.shards):
                if shard.master.grad is not None:
                    experts[g] = (shard.owned_E.clone(), shard.master.grad.detach().float().clone())
        into.append({"dense": dense, "experts": experts})

    stage.before_step = before_step


def regrouped(step: int, gas: int, dp_rank: int, *, dp: int, saved_dp: int):
    """Pipeline ``dp_rank`` of ``dp``'s ``gas`` micro-batches of ``step`` when the data-parallel run
    had ``saved_dp`` ranks: the same global batch cut into other pipelines."""
    per = gas * dp // saved_dp  # micro-steps of the saved run
    every = [batch(step, micro, r) for micro in range(per) for r in range(saved_dp)]
    return iter(every[dp_rank * gas:(dp_rank + 1) * gas])


def train_pipeline(rank: int, cfg: dict, steps: int, *, stages: int = STAGES, engine_hook=None, load=None,
                   save=None, save_at=None, saved_dp=None) -> dict:
    """Train ``cfg`` with ``stages`` stages; this rank's losses, norms, pre-step gradients, final dense
    parameters (GPTMoE names) and full expert tensors by global layer index. ``load``: a checkpoint
    directory to resume from (its steps are not run again; ``saved_dp``: the data-parallel size that
    wrote it, whose global batches are cut into this run's pipelines); ``save``: where to save after
    step ``save_at`` (default: the last)."""
    import ds_fssdp
    model, pipe = build(cfg, stages=stages)
    engine, *_ = ds_fssdp.initialize(model=pipe, config=ds_part(cfg))
    if engine_hook is not None:
        engine_hook(engine)
    start = 0
    if load is not None:
        engine.load_checkpoint(load)
        start = engine.global_steps
    grads = []
    _capture_before_step(engine, grads)
    forwards = _record_forwards(engine)
    dp_rank, dp = engine.grid.get_data_parallel_id(), engine.grid.get_data_parallel_world_size()
    gas = cfg["gradient_accumulation_steps"]
    losses, norms, factors, peaks, replicas, applied, migrated = [], [], [], [], [], [], []
    for step in range(start, steps):
        if saved_dp is not None and saved_dp != dp:
            batches = regrouped(step, gas, dp_rank, dp=dp, saved_dp=saved_dp)
        else:
            batches = data(step, gas, dp_rank)
        engine.fssdp.memory.reset_peak()
        losses.append(float(engine.train_batch(data_iter=batches)))
        norms.append(engine.fssdp.last_step.get("global_grad_norm"))
        factors.append(engine.fssdp.last_step.get("expert_grad_factor"))
        peaks.append(engine.fssdp.last_step.get("replica_bytes_peak"))
        replicas.append(sum(l.last_stats.get("replicas", 0) for l in engine.fssdp.layers))
        applied.append(engine.fssdp.last_step.get("applied"))
        migrated.append(engine.fssdp.last_step.get("reshard_bytes_sent"))
        if save is not None and step + 1 == (steps if save_at is None else save_at):
            engine.save_checkpoint(save)
    engine.fssdp.close()
    dense = {engine.module.model_names[n]: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    experts = {g: {k: v.float() for k, v in layer_tensors(layer).items()}
               for g, layer in zip(engine.fssdp.global_layers, engine.fssdp.layers)}
    return dict(losses=losses, norms=norms, factors=factors, grads=grads, dense=dense, experts=experts,
                stage=engine.stage_id, replica_peaks=peaks, replicas=replicas, forwards=forwards, applied=applied,
                migrated=migrated, in_flight=engine.fssdp.in_flight,
                gaps=list(engine.fssdp.last_step.get("edp_reduce_in_gaps", [])),
                global_layers=list(engine.fssdp.global_layers))


def _record_forwards(engine) -> list:
    """Per training forward of this stage (a list per micro-batch): each layer's replica bytes."""
    forwards = []
    stage = engine.fssdp
    begin = stage.begin_forward

    def begin_forward():
        begin()
        forwards.append([])

    stage.begin_forward = begin_forward
    for shard in stage.shards:
        run = shard.forward

        def forward(*args, run=run, shard=shard, **kwargs):
            out = run(*args, **kwargs)
            if out[1] is not None:  # not a recompute
                forwards[-1].append(shard.stats["replica_bytes_local"])
            return out

        shard.forward = forward
    return forwards


def reference(cfg: dict, *, dp: int, steps: int) -> dict:
    """One process, the whole GPTMoE, every pipeline's micro-batches: DeepSpeed's data-parallel
    math (loss / (dp * G), one global-norm clip, the same optimizer), with each step's pre-clip
    gradients and norm, and each step's mean loss."""
    torch.manual_seed(0)
    model = model_for(cfg)
    for layer in model.moe_layers():  # what the FSSDP stage does with the key
        layer.router_bias_update_rate = float(cfg["fssdp"].get("router_bias_update_rate", 0.0))
    params = [p for p in model.parameters() if p.requires_grad]
    opt_cfg = cfg["optimizer"]
    kwargs = dict(opt_cfg["params"])
    kwargs.pop("torch_adam", None)
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adam": torch.optim.AdamW}[opt_cfg["type"].lower()]
    opt = cls(params, **kwargs)
    gas = cfg["gradient_accumulation_steps"]
    losses, norms, grads = [], [], []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(gas):
            for r in range(dp):
                x, y = batch(step, micro, r)
                loss = model(x, y)
                (loss / (dp * gas)).backward()
                total += loss.item()
        losses.append(total / (dp * gas))
        dense = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "moe.w_" not in n}
        experts = [layer.spec.flatten({n: getattr(layer, n).grad for n in layer.spec.names})
                   for layer in model.moe_layers()]
        grads.append({"dense": dense, "experts": experts})
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg["gradient_clipping"] or 1e30)))
        opt.step()
        for layer in model.moe_layers():
            layer.update_routing_bias()
    dense = {n: p.detach().clone() for n, p in model.named_parameters() if "moe.w_" not in n}
    experts = [layer_tensors(layer) for layer in model.moe_layers()]
    return dict(losses=losses, norms=norms, grads=grads, dense=dense, experts=experts)


def assert_matches(got: dict, ref: dict, *, tol: dict, grads: bool = True, name: str = "") -> dict:
    """One rank's run equals the reference: the losses train_batch returned, the global norms, the
    pre-step gradients (dense at ZeRO 0; each owned expert row where the state is replicated), this
    stage's dense parameters and its layers' full expert tensors. Returns how many pre-step
    gradient tensors were compared ({"dense": n, "experts": n})."""
    compared = {"dense": 0, "experts": 0}
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **tol,
                               msg=lambda m: f"{name} losses: {m}")
    as64 = lambda xs: torch.tensor(xs, dtype=torch.float64)
    torch.testing.assert_close(as64(got["norms"]), as64(ref["norms"]), **tol,
                               msg=lambda m: f"{name} norms: {m}")
    if grads:
        for step, (g, w) in enumerate(zip(got["grads"], ref["grads"])):
            for n, t in g["dense"].items():
                torch.testing.assert_close(t, w["dense"][n], **tol, msg=lambda m: f"{name} step {step} grad {n}: {m}")
                compared["dense"] += 1
            for layer, (owned, rows) in g["experts"].items():
                torch.testing.assert_close(rows, w["experts"][layer][owned], **tol,
                                           msg=lambda m: f"{name} step {step} layer {layer} expert grads: {m}")
                compared["experts"] += 1
    for n, p in got["dense"].items():
        torch.testing.assert_close(p, ref["dense"][n], **tol, msg=lambda m: f"{name} {n}: {m}")
    for layer, tensors in got["experts"].items():
        for n, t in tensors.items():
            torch.testing.assert_close(t, ref["experts"][layer][n], **tol,
                                       msg=lambda m: f"{name} layer {layer} {n}: {m}")
    return compared


def model_cfg_layers(cfg: dict) -> int:
    from training import MODEL
    return dataclasses.replace(MODEL, **cfg.get("_model", {})).n_layers

"""Shared pieces of the training-equivalence tests: a tiny GPT-MoE, its data, DeepSpeed configs, the
distributed worker and the single-process reference it is compared with."""
from __future__ import annotations

import copy
import dataclasses

import torch

from ds_fssdp.models import GPTMoE, GPTMoEConfig

MODEL = GPTMoEConfig(vocab_size=64, seq_len=16, d_model=16, n_heads=2, n_layers=2, ffn_hidden=24, num_experts=8,
                     k=2, aux_loss_coef=0.01, z_loss_coef=0.001, init_std=0.2)
MICRO = 2  # sequences per rank per micro-step


def batch(step: int, micro: int, rank: int, cfg: GPTMoEConfig = MODEL):
    gen = torch.Generator().manual_seed(100_000 * step + 1000 * micro + rank)
    # A skewed token distribution, so that routing is skewed too and replicas matter.
    probs = torch.arange(cfg.vocab_size, 0, -1, dtype=torch.float).pow(2)
    seq = torch.multinomial(probs, MICRO * (cfg.seq_len + 1), replacement=True, generator=gen)
    seq = seq.view(MICRO, cfg.seq_len + 1)
    return seq[:, :-1], seq[:, 1:]


WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05, "warmup_max_lr": 0.5, "warmup_num_steps": 3}}


def ds_config(*, world, zero=0, gas=2, policy="fssdp", optimizer=None, clip=0.3, bf16=False, fssdp=None,
              scheduler=None):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "train_batch_size": MICRO * gas * world,
        "optimizer": optimizer or {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
        "gradient_clipping": clip,
        "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True,  # SGD under ZeRO 1/2
        "steps_per_print": 10**9,
        "fssdp": dict({"policy": policy, "materialization_budget": 2, "overlap_degree": 4, "load_window": 2},
                      **(fssdp or {})),
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if scheduler:
        cfg["scheduler"] = scheduler
    return cfg


def client_sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def freeze_experts(model) -> None:
    for layer in model.moe_layers():
        for p in layer.expert_parameters():
            p.requires_grad_(False)


def model_for(cfg: dict) -> GPTMoE:
    """MODEL, with a run's ``"_model"`` overrides (a key of the test's config, not DeepSpeed's)."""
    return GPTMoE(dataclasses.replace(MODEL, **cfg.get("_model", {})))


def layer_tensors(layer) -> dict:
    """A layer's full expert tensors, and its bound router bias (moved by the routing-bias rule)."""
    tensors = layer.export_experts()
    if layer.router_bias is not None:
        tensors["router_bias"] = layer.router_bias.detach().clone()
    return tensors


def train_worker(rank, world, runs: dict, steps: int):
    """Train every run's config on this rank; return losses, final weights and statistics. A run
    whose fssdp section has ``"_frozen_experts": true`` freezes every expert first."""
    import ds_fssdp
    out = {}
    for name, cfg in runs.items():
        torch.manual_seed(0)
        model = model_for(cfg)
        cfg = copy.deepcopy(cfg)
        cfg.pop("_model", None)
        if cfg["fssdp"].pop("_frozen_experts", False):
            freeze_experts(model)
        client = None
        if cfg["optimizer"] == "client":
            del cfg["optimizer"]
            client = client_sgd(model.parameters())  # holds the full expert parameters too
        engine, *_ = ds_fssdp.initialize(model=model, config=cfg, optimizer=client)
        gas = cfg["gradient_accumulation_steps"]
        losses, replicas, factors, norms, peaks, local_bytes, migrated, layer_stats = [], [], [], [], [], [], [], []
        decisions = []  # per micro-step, per layer: (degrees, traffic_DD, one_copy) of the layer's Decision
        layers_peaks = []
        for step in range(steps):
            for micro in range(gas):
                x, y = batch(step, micro, rank)
                loss = engine(x, y)
                engine.backward(loss)
                peaks.append(engine.fssdp.memory.peak)
                layers_peaks.append(engine.fssdp.memory.layers_peak)
                engine.fssdp.memory.reset_peak()
                local_bytes.append([l.last_stats["replica_bytes_local"] for l in model.moe_layers()])
                keys = ("shadowed", "calibration", "overlap_degree", "straggler", "pipeline_degree_fwd",
                        "pipeline_degree_bwd", "a2a_bytes_saved", "a2a_bytes_saved_inter", "one_copy")
                layer_stats.append([{k: l.last_stats.get(k) for k in keys} for l in model.moe_layers()])
                decisions.append([None if l.sharded.last_decision is None else
                                  (list(l.sharded.last_decision.degrees), l.sharded.last_decision.traffic_DD.tolist(),
                                   l.sharded.last_decision.one_copy)
                                  for l in model.moe_layers()])
                engine.step()
                losses.append(loss.item())
                replicas.append(sum(l.last_stats["replicas"] for l in model.moe_layers()))
            factors.append(engine.fssdp.last_step["expert_grad_factor"])
            norms.append(engine.fssdp.last_step["global_grad_norm"])
            migrated.append(engine.fssdp.last_step["reshard_bytes_sent"])
        engine.fssdp.close()
        dense = gathered_dense(engine)
        experts = [{k: v.float() for k, v in layer_tensors(l).items()} for l in model.moe_layers()]
        opt = engine.fssdp.optimizer
        states = [{k: tuple(v.shape) for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
                  for st in (opt.state.values() if opt is not None else [])]
        owned = [int(l.sharded.owned_E.numel()) for l in model.moe_layers()]
        out[name] = dict(losses=losses, dense=dense, experts=experts, replicas=replicas, factors=factors,
                         norms=norms, expert_states=states, owned=owned, replica_peaks=peaks,
                         replica_layers_peaks=layers_peaks,
                         replica_bytes_local=local_bytes, migrated=migrated, layer_stats=layer_stats,
                         decisions=decisions, token_bytes=model.moe_layers()[0].sharded.spec.cost_shape(4).token_bytes,
                         expert_shape=dataclasses.asdict(model.moe_layers()[0].sharded.spec.cost_shape(4)),
                         schedule_costs=None if engine.fssdp.schedule_costs is None else
                         dataclasses.asdict(engine.fssdp.schedule_costs),
                         # the costs the by-time decisions price plans with (None: no cost model)
                         price_costs=None if getattr(engine.fssdp.cost, "costs", None) is None else
                         dataclasses.asdict(engine.fssdp.cost.costs),
                         hardware=None if engine.fssdp.cost is None else dataclasses.asdict(engine.fssdp.cost.hw),
                         budget=engine.fssdp.budget, state_bytes=engine.fssdp.state_bytes(),
                         owners=[l.sharded.owner_E.clone() for l in model.moe_layers()])
    return out


def gathered_dense(engine) -> dict:
    """The dense parameters, whole (ZeRO-3 gathers its partitions; a no-op for stages 0-2)."""
    from deepspeed.runtime.zero import GatheredParameters
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _uniform_gates(model, current):
    """The ``uniform`` policy's routing in the reference: rank r's tokens are assigned round robin
    starting at expert r, as each rank does."""
    from ds_fssdp.moe.gate import uniform_assignment
    for layer in model.moe_layers():
        gate, forward = layer.gate, layer.gate.forward

        def patched(x_TH, gate=gate, forward=forward):
            out = forward(x_TH)
            return uniform_assignment(out, gate.num_experts, rank=current["rank"])

        gate.forward = patched


def reference_train(cfg: dict, world: int, steps: int):
    """One process, the whole model, every rank's micro-batches: DeepSpeed's data-parallel math
    (loss / (world * gas), global-norm clipping, the same optimizer)."""
    torch.manual_seed(0)
    model = model_for(cfg)
    for layer in model.moe_layers():  # what the FSSDP stage does with the key
        layer.router_bias_update_rate = float(cfg["fssdp"].get("router_bias_update_rate", 0.0))
    if cfg["fssdp"].get("_frozen_experts"):
        freeze_experts(model)
    current = {"rank": 0}
    if cfg["fssdp"].get("policy") == "uniform":
        _uniform_gates(model, current)
    opt_cfg = cfg["optimizer"]
    if opt_cfg == "client":
        opt = client_sgd([p for p in model.parameters() if p.requires_grad])
    else:
        params = dict(opt_cfg["params"])
        params.pop("torch_adam", None)
        cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adam": torch.optim.AdamW}[opt_cfg["type"].lower()]
        opt = cls([p for p in model.parameters() if p.requires_grad], **params)
    scheduler = None
    if "scheduler" in cfg:
        from deepspeed.runtime.lr_schedules import WarmupLR
        scheduler = WarmupLR(opt, **cfg["scheduler"]["params"])
    gas = cfg["gradient_accumulation_steps"]
    losses, norms = {}, []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(gas):
            for rank in range(world):
                current["rank"] = rank
                x, y = batch(step, micro, rank)
                loss = model(x, y)
                (loss / (world * gas)).backward()
                losses[(step, micro, rank)] = loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                          cfg["gradient_clipping"] or 1e30)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        for layer in model.moe_layers():
            layer.update_routing_bias()
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    experts = [layer_tensors(l) for l in model.moe_layers()]
    return losses, dense, experts, norms


def assert_same_training(got: dict, want: dict, *, tol: dict, name: str = "") -> None:
    """Two runs of :func:`train_worker` on one rank: the same losses, dense weights and expert
    weights within ``tol``."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **tol)
    for n, p in got["dense"].items():
        torch.testing.assert_close(p, want["dense"][n], **tol, msg=lambda m: f"{name} {n}: {m}")
    for layer, (g, w) in enumerate(zip(got["experts"], want["experts"])):
        for n in w:
            torch.testing.assert_close(g[n], w[n], **tol, msg=lambda m: f"{name} layer {layer} {n}: {m}")


def assert_matches_reference(per_rank: list, cfg: dict, *, world: int, steps: int, tol: dict, name: str) -> dict:
    """Every rank's losses, global norms, dense weights and full expert tensors (``train_worker``'s
    results of one run, in rank order) equal the single-process reference; returns its dense weights."""
    ref_losses, ref_dense, ref_experts, ref_norms = reference_train(cfg, world, steps)
    gas = cfg["gradient_accumulation_steps"]
    for rank, got in enumerate(per_rank):
        want = [ref_losses[(s, m, rank)] for s in range(steps) for m in range(gas)]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), **tol)
        # One global norm over dense and expert gradients, as the single process computes it.
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref_norms), **tol)
        for n, p in got["dense"].items():
            torch.testing.assert_close(p, ref_dense[n].float(), **tol, msg=lambda m: f"{name} {n}: {m}")
        for layer, (g, w) in enumerate(zip(got["experts"], ref_experts)):
            for n in w:
                torch.testing.assert_close(g[n], w[n].float(), **tol, msg=lambda m: f"{name} layer {layer} {n}: {m}")
    return ref_dense

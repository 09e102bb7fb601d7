"""A float-input model with one FSSDPMoE layer for the edge-case, failure and determinism tests:
its data (any tokens per rank, optional drifting skew), DeepSpeed configs, the engine worker and
the single-process reference (DeepSpeed's data-parallel math by hand: SGD with momentum, no
clipping, loss / (world * gas))."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from ds_fssdp import FSSDPMoE

H, F = 8, 12
LR, MOMENTUM = 0.1, 0.9


class Toy(nn.Module):

    def __init__(self, *, num_experts: int, k: int, hot_expert: int | None = None):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.moe = FSSDPMoE(hidden_size=H, ffn_hidden_size=F, num_experts=num_experts, k=k, init_std=0.3)
        shift = torch.zeros(H)
        if hot_expert is not None:
            # Every hidden state gets +3 on feature 0 and the hot expert's gate row weighs it by 20:
            # its logit wins by ~40 for every token, through a few SGD steps.
            shift[0] = 3.0
            with torch.no_grad():
                self.moe.gate.weight[hot_expert, 0] = 20.0
        self.register_buffer("shift", shift)
        self.last_counts = None

    def forward(self, x_TH, y_TH):
        h = torch.tanh(self.inp(x_TH.to(self.inp.weight.dtype))) + self.shift.to(self.inp.weight.dtype)
        out, l_aux, counts = self.moe(h)
        self.last_counts = counts
        return ((out.float() - y_TH) ** 2).sum() / 16 + 0.01 * l_aux


def toy_batch(step: int, micro: int, rank: int, tokens=6, drift: bool = False):
    """``tokens``: an int or ``f(step, micro, rank)``. ``drift``: a mean that moves with the step,
    so the gate's favourite experts drift."""
    T = tokens(step, micro, rank) if callable(tokens) else tokens
    gen = torch.Generator().manual_seed(100_000 * step + 1000 * micro + rank)
    x = torch.randn(T, H, generator=gen)
    if drift:
        x[:, 1] += 2.0 * math.cos(step / 7)
        x[:, 2] += 2.0 * math.sin(step / 7)
    return x, torch.randn(T, H, generator=gen)


def toy_config(*, world: int, gas: int = 2, zero: int = 0, bf16: bool = False, fssdp=None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "train_batch_size": gas * world,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "fssdp": dict({"materialization_budget": 2, "overlap_degree": 4, "load_window": 2, "metrics_csv": None},
                      **(fssdp or {})),
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def toy_engine(cfg: dict, model_kwargs: dict, seed: int = 0):
    import ds_fssdp
    torch.manual_seed(seed)
    model = Toy(**model_kwargs)
    engine, *_ = ds_fssdp.initialize(model=model, config=copy.deepcopy(cfg))
    return engine, model


def leaks(engine) -> dict:
    """Replica and collective bookkeeping that must be empty between steps."""
    shards = engine.fssdp.shards
    return {"replica_bytes": engine.fssdp.memory.current, "live": sum(len(s.replicas._live) for s in shards),
            "pending": sum(len(s.replicas.pending) for s in shards), "gathers": sum(s._gather is not None for s in shards)}


def expert_rows(engine) -> dict:
    """This rank's experts: (layer, expert) -> master row and every optimizer row, plus the
    per-layer optimizer scalars under (layer, None). Gathered from the EDP slices when the expert
    state is partitioned (collective: every rank calls it)."""
    out = {}
    stage = engine.fssdp
    for l, shard in enumerate(stage.shards):
        master, rows, scalars = stage.expert_state.full_state(l)
        for i, e in enumerate(shard.owned_E.tolist()):
            row = {"master": master[i].clone()}
            row.update({k: v[i].clone() for k, v in rows.items()})
            out[(l, e)] = row
        out[(l, None)] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()}
    return out


def weights(engine, model) -> dict:
    """Dense parameters and full expert tensors (collective), fp32."""
    from training import gathered_dense
    out = gathered_dense(engine)  # whole under ZeRO 3 too
    out.update({f"moe.{k}": v.float() for k, v in model.moe.export_experts().items()})
    return out


def toy_reference(model_kwargs: dict, *, world: int, gas: int, steps: int, tokens=6, drift: bool = False):
    torch.manual_seed(0)
    model = Toy(**model_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = {}
    for step in range(steps):
        opt.zero_grad()
        for micro in range(gas):
            for rank in range(world):
                x, y = toy_batch(step, micro, rank, tokens, drift)
                loss = model(x, y)
                (loss / (world * gas)).backward()
                losses[(step, micro, rank)] = loss.item()
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

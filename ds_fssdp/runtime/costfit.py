"""The schedule's cost model fitted on this machine (``planner.schedule.ScheduleCosts``): short
measurements at initialize, refitted from the run's own timings (docs/design.md section 5).

Legend: D ranks, L MoE layers, R rows, H hidden.

At initialize (``measure``): the token all-to-all over the token group at a few sizes (with
several nodes once per link class), and the layer's compute between the exchanges (permutations,
grouped expert MLP over the experts a rank owns, combine) forward and backward over a few row
counts; one warm-up, then the median of ``repeats``. While training (``CostFit.refit``): each
layer's ``moe.timing.LayerTimings`` spans of the same work. Every rank's samples are agreed in one
all-reduce (MAX: an exchange, seen by every rank, takes the largest bytes and the shortest wait;
compute samples are every rank's own) before ``schedule.fit_schedule_costs``, so every rank fits
the same costs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from deepspeed import comm as dist

from ds_fssdp import ops
from ds_fssdp.moe.experts import ExpertSpec
from ds_fssdp.planner.schedule import ScheduleCosts, fit_schedule_costs
from ds_fssdp.runtime.profile import median_seconds
from ds_fssdp.topology import Topology

RUN_SAMPLES = 16  # per layer and kind, the newest, at each refit


@dataclass
class CostFit:
    """The fitted costs, their error, and the samples they came from (every rank's are equal)."""
    costs: ScheduleCosts
    error: float
    base: dict  # the initial measurements: intra, inter [(bytes, s)], gemm_fwd, gemm_bwd [(rows, s)]
    run: dict = field(default_factory=dict)  # the last agreed run samples, same keys
    refits: int = 0

    def refit(self, timings: list, *, group=None, device="cpu") -> None:
        """Agree on the layers' recorded spans (``timings``: LayerTimings per layer, in model
        order; collective over ``group``) and fit again from them and the initial samples."""
        self.run = agree_run_samples(timings, self.costs, group=group, device=device)
        merged = {k: list(self.base.get(k, [])) + list(self.run.get(k, [])) for k in ("intra", "inter", "gemm_fwd",
                                                                                      "gemm_bwd")}
        self.costs, self.error = fit_schedule_costs(merged["intra"], merged["inter"], merged["gemm_fwd"],
                                                    merged["gemm_bwd"], concurrent=self.costs.concurrent)
        self.refits += 1


def exchange_rows(token_bytes: int, *, max_bytes: int = 1 << 18) -> list:
    """Rows per peer of the initial exchange measurements: three sizes, the largest <= max_bytes."""
    top = max(4, min(512, max_bytes // max(1, token_bytes)))
    return sorted({max(1, top // 16), max(2, top // 4), top})


def gemm_rows(spec: ExpertSpec, *, flop_budget: float = 2e8) -> list:
    """Row counts of the initial GEMM measurements: four sizes, the largest within ``flop_budget``
    forward FLOPs (16 to 1024 rows)."""
    top = int(max(16, min(1024, flop_budget / (2.0 * spec.numel))))
    return sorted({max(1, top // 8), max(2, top // 4), max(3, top // 2), top})


def measure_exchange(*, group, topology: Topology, token_bytes: int, device, rows=None, repeats: int = 3) -> dict:
    """This rank's times of the all-to-all over ``group``: {"intra": [(bytes, s)], "inter": [...]}
    (bytes: what this rank sends over that link class; "inter" empty on one node; nothing on one
    rank)."""
    world = dist.get_world_size(group=group)
    rank = dist.get_rank(group=group)
    out = {"intra": [], "inter": []}
    if world == 1:
        return out
    rows = exchange_rows(token_bytes) if rows is None else rows
    node = topology.node_of(rank)
    classes = {"intra": [d != rank and topology.node_of(d) == node for d in range(world)]}
    if topology.num_nodes > 1:
        classes["inter"] = [topology.node_of(d) != node for d in range(world)]
    for name, peers in classes.items():
        if not any(peers):  # one rank per node: no intra-node peer
            continue
        for r in rows:
            n = max(1, r * token_bytes // 4)
            splits = [n if p else 0 for p in peers]
            send = torch.zeros(sum(splits), dtype=torch.float32, device=device)
            recv = torch.empty_like(send)
            seconds = median_seconds(lambda: dist.all_to_all_single(recv, send, output_split_sizes=splits,
                                                                    input_split_sizes=splits, group=group),
                                     repeats=repeats, cuda=send.is_cuda, before=lambda: dist.barrier(group=group))
            out[name].append((float(sum(splits) * 4), seconds))
    return out


def measure_gemm(spec: ExpertSpec, *, dtype, device, rows=None, experts: int = 1, repeats: int = 3) -> dict:
    """This rank's times of the layer's compute over ``rows`` rows, as ``moe/compute.py`` runs it
    between the exchanges: the send buffer's gather, the grouping by expert (``experts`` local
    experts, rows split evenly), the grouped expert MLP, the ungrouping and the combine:
    {"gemm_fwd": [(rows, s)], "gemm_bwd": [(rows, s)]} (the backward: input and weight
    gradients)."""
    rows = gemm_rows(spec) if rows is None else rows
    H = spec.shapes[spec.names[0]][0]
    w = {n: (torch.randn(experts, *s, dtype=dtype, device=device) * 0.02).requires_grad_()
         for n, s in spec.shapes.items()}
    out = {"gemm_fwd": [], "gemm_bwd": []}
    cuda = torch.device(device).type == "cuda"
    for r in rows:
        x = torch.randn(r, H, dtype=dtype, device=device, requires_grad=True)
        sizes = [r // experts + (e < r % experts) for e in range(experts)]
        gen = torch.Generator().manual_seed(r)
        send, group = (torch.randperm(r, generator=gen).to(device) for _ in range(2))
        unsend, ungroup = torch.argsort(send).view(-1, 1), torch.argsort(group)
        ones = torch.ones(r, 1, dtype=dtype, device=device)

        def layer_compute():
            grouped = ops.permute_tokens(ops.permute_tokens(x, send, unsend), group, ungroup.view(-1, 1))
            y = ops.expert_mlp(grouped, w, sizes, activation=spec.activation, act_params=spec.act_params)
            return ops.unpermute_combine(ops.permute_tokens(y, ungroup, group.view(-1, 1)), unsend, ones)
        graph = []

        def forward():  # untimed, ahead of each timed backward: a fresh graph, no gradients
            for t in (x, *w.values()):
                t.grad = None
            graph[:] = [layer_compute()]
            if cuda:
                torch.cuda.synchronize()
        out["gemm_fwd"].append((float(r), median_seconds(layer_compute, repeats=repeats, cuda=cuda)))
        out["gemm_bwd"].append((float(r), median_seconds(lambda: graph[0].backward(torch.ones_like(graph[0])),
                                                         repeats=repeats, cuda=cuda, before=forward)))
    return out


def agree_max(samples: dict, *, group=None, device="cpu") -> dict:
    """Every rank's seconds replaced by the largest any rank measured (units are equal on every
    rank: the same sizes were measured). One all-reduce."""
    keys = sorted(samples)
    flat = torch.tensor([s for k in keys for _, s in samples[k]], dtype=torch.float64, device=device)
    if flat.numel():
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    vals = iter(flat.tolist())
    return {k: [(u, next(vals)) for u, _ in samples[k]] for k in keys}


def measure(*, group, topology: Topology, spec: ExpertSpec, dtype, device, experts: int = 1, repeats: int = 3,
            agree_group=None) -> CostFit:
    """The initial fit (collective over ``group`` and ``agree_group``, None: the world);
    ``experts``: the experts a rank holds (its GEMM's groups)."""
    token_bytes = spec.shapes[spec.names[0]][0] * torch.tensor([], dtype=dtype).element_size()
    samples = measure_exchange(group=group, topology=topology, token_bytes=token_bytes, device=device, repeats=repeats)
    samples.update(measure_gemm(spec, dtype=dtype, device=device, experts=experts, repeats=repeats))
    samples = agree_max(samples, group=agree_group, device=device)
    if not samples["intra"]:  # one rank (or one rank per node): exchanges cost nothing measurable
        samples["intra"] = [(1.0, 1e-9), (2.0, 1e-9)]
    # Exchanges overlap the compute only where the collectives have their own streams (CUDA); on
    # CPU ranks gloo's threads share the compute's cores (planner.schedule.ScheduleCosts.concurrent).
    costs, error = fit_schedule_costs(samples["intra"], samples["inter"], samples["gemm_fwd"], samples["gemm_bwd"],
                                      concurrent=torch.device(device).type == "cuda")
    return CostFit(costs=costs, error=error, base=samples)


def agree_run_samples(timings: list, costs: ScheduleCosts, *, group=None, device="cpu") -> dict:
    """The layers' recorded spans, agreed by every rank (one all-reduce, MAX; module docstring), as
    fit samples. Exchanges are assigned to the link class whose part the current ``costs`` say
    takes longer."""
    world = dist.get_world_size(group=group)
    rank = dist.get_rank(group=group)
    n, L = RUN_SAMPLES, len(timings)
    a2a = torch.zeros(L, n, 3, dtype=torch.float64)  # intra bytes, inter bytes, -seconds
    gemm = torch.zeros(2, world, L, n, 2, dtype=torch.float64)  # fwd/bwd, rank, layer, slot: rows, seconds
    for l, t in enumerate(timings):
        for i, ((intra, inter), s) in enumerate(t.samples("a2a")[-n:]):
            a2a[l, i] = torch.tensor([intra, inter, -s], dtype=torch.float64)
        for j, kind in enumerate(("compute_fwd", "compute_bwd")):
            for i, ((r,), s) in enumerate(t.samples(kind)[-n:]):
                gemm[j, rank, l, i] = torch.tensor([r, s], dtype=torch.float64)
    flat = torch.cat([a2a.ravel(), gemm.ravel()]).to(device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    flat = flat.cpu()
    a2a, gemm = flat[:a2a.numel()].view(L * n, 3), flat[a2a.numel():].view(2, -1, 2)
    out = {"intra": [], "inter": [], "gemm_fwd": [], "gemm_bwd": []}
    for intra, inter, neg_s in a2a.tolist():
        if neg_s >= 0:  # a slot some rank had no sample for
            continue
        if costs.a2a_inter(inter) > costs.a2a_intra(intra):
            out["inter"].append((inter, -neg_s))
        else:
            out["intra"].append((intra, -neg_s))
    for j, kind in enumerate(("gemm_fwd", "gemm_bwd")):
        out[kind] = [(r, s) for r, s in gemm[j].tolist() if r > 0 and s > 0]
    return out

"""The chunked token-exchange pipeline (moe/pipeline.py) equals the single-process layer: degrees
1 to 4 with forward != backward, empty and one-row chunks, ragged splits, 1, 2 and 4 logical
nodes (intra- and inter-node groups), re-materialization on and off, under activation
checkpointing (reentrant and not), one copy per destination on (the default; more in
tests/test_pipeline_dedup.py) and off (``dedup=False``: one row per assignment); and multi-step
training through ds_fssdp.initialize at degrees (3, 2) equals degree 1."""
import dataclasses

import pytest
import torch

from distributed import spawn
from layer_cases import attach_shards, forward_backward, model_forward, rank_inputs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks (about 2 minutes)

H, F, E, K = 8, 12, 6, 2
WORLD = 4
CASES = [
    # degrees (forward, backward), ranks per node, tokens per rank, two chained layers, RM, checkpoint
    dict(seed=1, deg=(2, 3), rpn=4, act="gelu", tokens=(7, 5, 9, 3)),
    dict(seed=2, deg=(3, 2), rpn=2, act="swiglu", tokens=(4, 11, 6, 8), dedup=False),
    dict(seed=3, deg=(4, 4), rpn=2, act="gelu", tokens=(1, 2, 0, 3)),  # empty and one-row chunks
    dict(seed=4, deg=(1, 4), rpn=1, act="swiglu", tokens=(13, 2, 5, 9)),
    dict(seed=5, deg=(4, 1), rpn=2, act="gelu", tokens=(6, 0, 17, 4), dedup=False),
    dict(seed=6, deg=(3, 2), rpn=2, act="swiglu", tokens=(9, 7, 3, 12), layers=2, remat=True),
    dict(seed=7, deg=(2, 3), rpn=2, act="gelu", tokens=(5, 8, 11, 2), layers=2, ckpt="torch", dedup=False),
    dict(seed=8, deg=(4, 3), rpn=4, act="gelu", tokens=(10, 3, 6, 7), layers=2, remat=True, ckpt="reentrant"),
    dict(seed=9, deg=(1, 1), rpn=2, act="swiglu", tokens=(7, 5, 9, 3)),  # today's path
    dict(seed=10, deg=(3, 2), rpn=2, act="gelu", tokens=(6, 9, 4, 7), lora=True),  # LoRA factors on w_a
    dict(seed=11, deg=(2, 3), rpn=2, act="gelu", tokens=(8, 3, 5, 7), lora=True, dedup=False),
]
TOL = dict(atol=2e-6, rtol=1e-5)  # fp32: only the summation order of identical products differs


def make_layers(case):
    from ds_fssdp import FSSDPMoE
    torch.manual_seed(case["seed"])
    return [FSSDPMoE(hidden_size=H, ffn_hidden_size=F, num_experts=E, k=K, activation=case["act"], init_std=0.3)
            for _ in range(case.get("layers", 1))]


def lora_factors(case):
    """Per-expert LoRA factors on w_a (leaves) and the callable a layer takes."""
    from ds_fssdp.ops.lora import LoraFactors
    gen = torch.Generator().manual_seed(7 + case["seed"])
    a = torch.randn(E, H, 2, generator=gen).requires_grad_(True)
    b = torch.randn(E, 2, F, generator=gen).requires_grad_(True)
    return (a, b), lambda local_E: {"w_a": [LoraFactors(a[local_E], b[local_E], 0.5)]}


def placements(case, world, n):
    from ds_fssdp.planner import shard_placement
    gen = torch.Generator().manual_seed(100 + case["seed"])
    out = []
    for _ in range(n):
        owner_E = torch.randint(0, world, (E, ), generator=gen)
        out.append((owner_E, shard_placement(owner_E, world) | (torch.rand(E, world, generator=gen) < 0.4)))
    return out


def _worker(rank, world, cases):
    from ds_fssdp import Topology
    from ds_fssdp.moe.sharded import ShardOptions
    from ds_fssdp.runtime.groups import build_exchange_groups
    groups = {rpn: build_exchange_groups(world=world, rank=rank, group_size=world, ranks_per_node=rpn)
              for rpn in sorted({c["rpn"] for c in cases})}
    out = []
    for case in cases:
        layers = make_layers(case)
        factors = []

        if case.get("lora"):  # the layer hands its factors to the sharded forward
            factors, fn = lora_factors(case)
            layers[0].lora_factors = lambda: fn

        shards = attach_shards(layers, placements(case, world, len(layers)), rank=rank,
                               topo=Topology(num_ranks=world, ranks_per_node=case["rpn"]),
                               exchange=groups[case["rpn"]], degrees=case["deg"],
                               options=ShardOptions(rematerialize=case.get("remat", False),
                                                    one_copy_per_destination=case.get("dedup", True)))
        out.append(dict(forward_backward(layers, shards, case, rank, H),
                        lora=[f.grad for f in factors] if case.get("lora") else None,
                        dedup=[l.last_stats["a2a_meta_bytes"] > 0 for l in layers],  # routing entries sent
                        degrees=[(l.last_stats["pipeline_degree_fwd"], l.last_stats["pipeline_degree_bwd"])
                                 for l in layers]))
    return out


def _reference(case, world):
    layers = make_layers(case)
    if case.get("lora"):
        factors, fn = lora_factors(case)
        layers[0].lora_factors = lambda: fn
    per_rank = []
    for rank in range(world):
        for layer in layers:
            layer.zero_grad()
        x, dy = rank_inputs(case, rank, H)
        x.requires_grad_(True)
        y, l_aux = model_forward(layers, x, None)
        ((y * dy).sum() + 0.1 * l_aux).backward()
        per_rank.append(dict(y=y.detach(), x_grad=x.grad, gate_grads=[l.gate.weight.grad.clone() for l in layers],
                             expert_grads=[l.spec.flatten({n: getattr(l, n).grad for n in l.spec.names})
                                           for l in layers]))
    sums = [torch.stack([r["expert_grads"][i] for r in per_rank]).sum(0) for i in range(len(layers))]
    if case.get("lora"):  # accumulated over every rank's input
        sums.append([f.grad for f in factors])
    return per_rank, sums


def test_pipeline_matches_single_process():
    results = spawn(WORLD, _worker, CASES)
    for ci, case in enumerate(CASES):
        ref, sums = _reference(case, WORLD)
        if case.get("lora"):
            want_lora = sums.pop()
            for got_sum, want in zip(zip(*[results[r][ci]["lora"] for r in range(WORLD)]), want_lora):
                torch.testing.assert_close(torch.stack(got_sum).sum(0), want, **TOL)
        for rank in range(WORLD):
            got, want = results[rank][ci], ref[rank]
            where = f"case {ci} (seed {case['seed']}, degrees {case['deg']}) rank {rank}"
            assert got["degrees"] == [case["deg"]] * len(sums), where
            assert got["dedup"] == [case.get("dedup", True)] * len(sums), where
            torch.testing.assert_close(got["y"], want["y"], **TOL, msg=where)
            torch.testing.assert_close(got["x_grad"], want["x_grad"], **TOL, msg=where)
            for g, w in zip(got["gate_grads"], want["gate_grads"]):
                torch.testing.assert_close(g, w, **TOL, msg=where)
            for (owned_E, grad), total in zip(got["owned"], sums):
                torch.testing.assert_close(grad, total[owned_E], **TOL, msg=where)




AUTO_HARDWARE = {"flops": 1e7, "intra_bw": 1e12, "inter_bw": 1e12, "latency": 1e-9}
SLOW_LINKS = {"flops": 1e12, "intra_bw": 1e6, "inter_bw": 1e6, "latency": 1e-9}  # one copy per destination pays


def _check_degrees_recomputed(run: dict, hardware: dict, *, one_copy: bool) -> list:
    """The degrees (and, under ``one_copy`` "auto", one copy per destination) the runtime recorded
    equal the schedule's decisions recomputed from each recorded plan's traffic, by the runtime's
    function (choose_exchange, on the costs of the configured hardware), by hand (without one copy:
    choose_degrees over loads_from_traffic) and by the simulator's layer pricing
    (sim/pipeline.LayerSchedule). The one-copy decisions recorded."""
    import numpy as np
    from ds_fssdp.planner.cost import ExpertShape, Hardware, schedule_costs
    from ds_fssdp.planner.onecopy import choose_exchange
    from ds_fssdp.planner.schedule import choose_degrees, loads_from_traffic
    from ds_fssdp.sim.pipeline import LayerSchedule, ScheduleOptions
    hw, shape = Hardware(**hardware), ExpertShape(**run["expert_shape"])
    costs = schedule_costs(hw, shape)
    assert dataclasses.asdict(costs) == run["schedule_costs"]
    sim = LayerSchedule(hw, shape, ranks_per_node=1, top_k=2,
                        options=ScheduleOptions(dedup="auto" if one_copy else False))
    recorded = [d for step in run["decisions"] for d in step if d is not None]
    assert recorded
    for degrees, traffic, taken in recorded:
        traffic_DD = np.asarray(traffic, dtype=np.int64)
        want = choose_exchange(costs, traffic_DD, ranks_per_node=1, token_bytes=run["token_bytes"], top_k=2,
                               weight_bytes=4, one_copy="auto" if one_copy else False, relay=False)
        assert (tuple(degrees), bool(taken)) == want
        lt = sim.layer(traffic_DD[None])
        assert tuple(degrees) == tuple(lt.degrees[0]) and bool(taken) == lt.one_copy[0]
        if not one_copy:
            loads = loads_from_traffic(traffic_DD, ranks_per_node=1, token_bytes=run["token_bytes"])
            assert tuple(degrees) == choose_degrees(costs, loads) and taken == 0
    return [t for _, _, t in recorded]


def test_engine_training_at_degrees_3_2_equals_degree_1():
    import training
    from training import ds_config
    world, steps = 2, 3
    runs = {name: ds_config(world=world, zero=1, fssdp=dict({"ranks_per_node": 1}, **extra))
            for name, extra in {"d1": {"pipeline_degree": 1},
                                "d32": {"pipeline_degree": {"forward": 3, "backward": 2}},
                                "d32rm": {"pipeline_degree": {"forward": 3, "backward": 2}, "rematerialize": True},
                                # slow GEMMs, fast links: "auto" pipelines
                                "auto": {"hardware": AUTO_HARDWARE, "one_copy_per_destination": False},
                                # slow links: one copy per destination chosen where it pays
                                "auto1c": {"hardware": SLOW_LINKS, "one_copy_per_destination": "auto"}}.items()}
    res = spawn(world, training.train_worker, runs, steps)
    tight = dict(rtol=1e-5, atol=1e-6)  # fp32, SGD with momentum: summation order only
    for rank in range(world):
        base = res[rank]["d1"]
        for name in ("d32", "d32rm", "auto", "auto1c"):
            got = res[rank][name]
            degrees = {(s["pipeline_degree_fwd"], s["pipeline_degree_bwd"]) for it in got["layer_stats"] for s in it}
            if name == "auto":  # the same decision on every rank, iteration by iteration, layer by layer
                assert got["layer_stats"] == res[0][name]["layer_stats"]
                assert degrees - {(1, 1)}, degrees
                _check_degrees_recomputed(got, AUTO_HARDWARE, one_copy=False)
            elif name == "auto1c":
                assert got["layer_stats"] == res[0][name]["layer_stats"]
                taken = _check_degrees_recomputed(got, SLOW_LINKS, one_copy=True)
                assert any(taken), taken
            else:
                assert degrees == {(3, 2)}, (name, degrees)
            training.assert_same_training(got, base, tol=tight, name=name)
    assert {(s["pipeline_degree_fwd"], s["pipeline_degree_bwd"]) for it in res[0]["d1"]["layer_stats"]
            for s in it} == {(1, 1)}

"""The cluster simulator: its fast Algorithm 1 and 3 equal the planner's, the cost-model additions
mean what they say, and whole simulations behave (uniform loads: nothing to gain; one hot
expert: EP slowest; more bandwidth never slower); the CLI prints a table, JSON and a PNG. At
cluster scale: a dense dispatcher gives the compact one's numbers, groups plan alone and meet
at the all-reduce, the memory cap holds, load-CV traces have their CV, 1,024 GPUs run."""
import functools
import json
import os

import numpy as np
import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import (CostModel, ExpertShape, Hardware, dispatch, homogeneous_owner, materialize,
                              shard_placement)
from ds_fssdp.planner.baselines import POLICY_NAMES
from ds_fssdp.planner.dispatch import dispatch_plan
from ds_fssdp.sim.__main__ import main
from ds_fssdp.sim.cluster import CLUSTER_POLICIES, PolicyRun, plan_links, simulate, simulate_cluster
from ds_fssdp.sim.links import allreduce_links, sparse_collective_links
from ds_fssdp.sim.loadcv import LoadCVSource, load_cv
from ds_fssdp.sim.memory import budget_for_cap
from ds_fssdp.sim.pipeline import SERIAL
from ds_fssdp.sim.presets import cluster_preset, model_preset
from ds_fssdp.sim.setup import Setup, build_setup, derive_overlap_degree
from ds_fssdp.sim.synth import synthetic_trace

SHAPES = [(8, 8, 4), (8, 4, 2), (16, 8, 4), (4, 8, 2), (6, 4, 4), (32, 16, 4), (5, 3, 1), (3, 6, 3)]  # E, D, G
HW = Hardware(flops=100e12, intra_bw=200e9, inter_bw=25e9, latency=10e-6, hbm_bw=2e12)
SHAPE = ExpertShape(hidden=512, ffn=2048)


def test_cost_model_additions():
    topo = Topology(num_ranks=8, ranks_per_node=4)
    cost = CostModel(HW, SHAPE, topo)
    psi = SHAPE.expert_bytes
    owner = homogeneous_owner(8, 8)
    shard = shard_placement(owner, 8)
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        p = shard | (torch.rand(8, 8, generator=gen) < 0.3)
        assert cost.sparse_collective_time(owner, p, relay=False) == cost.gather_time(owner, p)
        assert cost.sparse_collective_time(owner, p) <= cost.gather_time(owner, p) + 1e-15
    # Broadcast expert 0 (node 0) to all: without relay node 0 sends it to the other node once
    # (one other node here), with relay the same; to 3 nodes the owner's node sends 3 vs 1 chunk.
    topo3 = Topology(num_ranks=12, ranks_per_node=4)
    cost3 = CostModel(HW, SHAPE, topo3)
    own3 = homogeneous_owner(12, 12)
    p = shard_placement(own3, 12)
    p[0] = True
    assert cost3.gather_time(own3, p) == pytest.approx(HW.latency + 2 * psi / HW.inter_bw)
    assert cost3.sparse_collective_time(own3, p) == pytest.approx(HW.latency + psi / HW.inter_bw)
    # All-reduce (Eq. 5): a group of 4 ranks in one node: 2 * 3/4 psi per member over intra links.
    groups = torch.zeros(2, 8, dtype=torch.bool)
    groups[0, :4] = True
    groups[1, 0] = True  # a group of one rank costs nothing
    assert cost.allreduce_time(groups, torch.tensor([psi, psi])) == pytest.approx(HW.latency + 1.5 * psi / HW.intra_bw)
    groups[0, 4] = True  # spans two nodes: each node's link carries 2 * 4/5 psi
    assert cost.allreduce_time(groups[:1], torch.tensor([psi])) == pytest.approx(
        HW.latency + max(1.6 * psi / HW.intra_bw, 1.6 * psi / HW.inter_bw))
    traffic = torch.zeros(8, 8)
    traffic[0, 5] = 7 * psi
    assert cost.transfer_time(traffic) == pytest.approx(HW.latency + 7 * psi / HW.inter_bw)
    # Batched layer times equal layer_time.
    plans = [dispatch(shard | (torch.rand(8, 8, generator=gen) < 0.2),
                             torch.randint(0, 100, (8, 8), generator=gen), topo) for _ in range(6)]
    plans.append(torch.zeros(8, 8, 8, dtype=torch.long))
    want = torch.tensor([cost.layer_time(pl) for pl in plans], dtype=torch.float64)
    got = cost.flow_layer_times(torch.stack([pl.sum(0) for pl in plans]).double())
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


def small_setup(hw=HW, **kw) -> Setup:
    topo = Topology(num_ranks=8, ranks_per_node=4)
    tokens, d, s = 16384, 512, 1024
    flops = 8.0 * d * d + 2.0 * s * d
    base = dict(topology=topo, hw=hw, shape=SHAPE, num_layers=2, num_experts=16, tokens_per_gpu=tokens,
                attention_flops_per_token=flops, dense_params=2 * 4 * d * d,
                overlap_degree=derive_overlap_degree(hw, topo, SHAPE, attention_s=tokens * flops / hw.flops),
                budget=3, budget_rm=6, flexmoe_slots=2, reshard_interval=8, smartmoe_interval=4)
    base.update(kw)
    return Setup(**base)


def skewed_tokens(steps, setup, *, std=0.1, seed=0):
    return synthetic_trace(steps=steps, num_layers=setup.num_layers, num_experts=setup.num_experts,
                           num_ranks=setup.topology.num_ranks, assignments_per_rank=2 * setup.tokens_per_gpu,
                           target_std=std, top_k=2, seed=seed).tokens_SLED


def by_name(results):
    return {r.policy: r for r in results}


def test_uniform_loads_leave_nothing_to_gain():
    setup = small_setup(reshard_interval=0)  # a re-shard amortizes over 100 steps, not the 5 timed here
    assert setup.overlap_degree >= 1
    tokens = np.full((10, 2, 16, 8), 2 * setup.tokens_per_gpu // 16, dtype=np.int32)
    # The placements' gain, on the serial schedule every policy shares (test_sim_schedule: the schedule's).
    res = by_name(simulate(setup, tokens, POLICY_NAMES, schedule=SERIAL))
    ep = res["ep"].iteration_s
    assert res["uniform"].iteration_s == pytest.approx(ep, rel=1e-12)
    for name in ("smartmoe", "flexmoe", "fastermoe"):
        assert res[name].iteration_s == pytest.approx(ep, rel=0.01), name
        assert res[name].migrated_experts == 0 and res[name].straggler == pytest.approx(1.0)
    for name in ("fssdp", "fssdp-rm"):
        # Algorithm 1 still replicates the (tied) top-t experts everywhere: their owners' node sheds
        # ingress, but the busiest other node keeps its traffic while its ranks now also compute
        # their own tokens of the replicas. About equal (here +4.7 %), never far off.
        assert res[name].iteration_s == pytest.approx(ep, rel=0.05), name


def test_one_hot_expert_makes_ep_slowest():
    setup = small_setup()
    tokens = np.full((10, 2, 16, 8), 200, dtype=np.int32)
    tokens[:, :, 5, :] = 2 * setup.tokens_per_gpu - 15 * 200
    res = by_name(simulate(setup, tokens, POLICY_NAMES))
    ep = res["ep"].iteration_s
    assert res["ep"].straggler > 5
    for name, r in res.items():
        if name not in ("ep", "smartmoe"):
            assert r.iteration_s < 0.8 * ep, name
    # SmartMoE can only move the hot expert, not split it: no faster than EP beyond its permutation.
    assert res["smartmoe"].iteration_s <= ep * 1.01


def test_more_bandwidth_is_never_slower():
    """The model is monotone in bandwidth, with FSSDP's t given (``fixed_t``). t and placement by
    time decide per layer on the predicted loads, so with more bandwidth they may take a placement
    that models faster on the prediction and runs slower on the actual loads: here FSSDP's
    searched run at 4x is 13.393 ms against 13.329 ms at 2x (with Algorithm 1 alone searched, 13.389
    against 13.392). That search never prices worse than the window's t on its own inputs
    (tests/test_overlap_by_time.py, tests/test_placement_by_time.py)."""
    base = small_setup()
    tokens = skewed_tokens(12, base, std=0.12, seed=3)
    previous = None
    for scale in (0.5, 1.0, 2.0, 4.0):
        hw = Hardware(flops=HW.flops, intra_bw=HW.intra_bw * scale, inter_bw=HW.inter_bw * scale,
                      latency=HW.latency, hbm_bw=HW.hbm_bw)
        res = by_name(simulate(base.with_hardware(hw), tokens, POLICY_NAMES, fixed_t=True))
        if previous is not None:
            for name in POLICY_NAMES:
                assert res[name].iteration_s <= previous[name].iteration_s * (1 + 1e-9), (name, scale)
        previous = res


def test_memory_accounting():
    setup = small_setup()
    tokens = skewed_tokens(10, setup, std=0.12, seed=4)
    res = by_name(simulate(setup, tokens, POLICY_NAMES))
    P = SHAPE.params
    owned = 2 * 2 * P  # two experts per rank per layer, two layers
    ep = res["ep"].memory_bytes
    assert ep["param"] == pytest.approx(2 * (setup.dense_params + owned))
    assert ep["opt"] == pytest.approx(12 * (setup.dense_params + owned))
    assert res["flexmoe"].memory_bytes["opt"] == pytest.approx(12 * (setup.dense_params + owned + 2 * 2 * P))
    assert res["fssdp"].memory_bytes["param"] > ep["param"], "replicas cost parameter memory"
    assert res["fssdp"].memory_bytes["opt"] == pytest.approx(ep["opt"]), "replicas carry no optimizer state"
    assert sum(res["flexmoe"].memory_bytes.values()) > sum(res["fssdp"].memory_bytes.values())


def test_presets_and_knobs():
    a, b = cluster_preset("a"), cluster_preset("b")
    assert a.hardware().inter_bw == pytest.approx(0.8 * 50e9) and b.hardware().inter_bw == pytest.approx(0.8 * 400e9)
    m = model_preset("gpt-s-moe")
    setup = build_setup(a, m, 32)
    assert setup.num_experts == 64 and setup.topology.num_nodes == 4 and setup.num_layers == 12
    t = int(setup.attention_fwd_s * setup.hw.inter_bw // setup.shape.expert_bytes)
    assert setup.overlap_degree == t and setup.budget_rm > setup.budget
    assert build_setup(b, m, 32).overlap_degree > setup.overlap_degree, "faster network, more overlap"
    assert model_preset("phi-3.5-moe").expert_shape().expert_bytes == 3 * 4096 * 6400 * 2
    with pytest.raises(ValueError, match=r"gpus \(12\)"):
        build_setup(a, m, 12)
    with pytest.raises(ValueError, match=r"cluster \('c'\)"):
        cluster_preset("c")


def test_cli_table_json_and_png(tmp_path, capsys):
    png = str(tmp_path / "chart.png")
    assert main(["--trace", "synthetic", "--gpus", "8", "--steps", "8", "--policies", "ep,uniform,fssdp", "--png", png,
                 "--target-std", "0.08", "--tokens-per-gpu", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == ["ep", "uniform", "fssdp"]
    assert out["speedup_vs_ep"]["ep"] == pytest.approx(1.0) and out["ep_slowdown_vs_uniform"] > 1
    assert set(out["results"][0]["breakdown_ms"]) == {"comp", "a2a", "spag", "rearr", "ar", "opt"}
    assert abs(out["trace"]["share_std"] - 0.08) < 0.01
    assert os.path.getsize(png) > 1000
    if os.path.exists("/work/shared/data/trace_e8.npz"):
        assert main(["--trace", "/work/shared/data/trace_e8.npz", "--gpus", "8", "--start", "100", "--steps", "8",
                     "--policies", "ep,fastermoe", "--tokens-per-gpu", "4096", "--no-png"]) == 0
        table = capsys.readouterr().out
        assert "remapped 4x8x8 -> 12x16x8" in table and "fastermoe" in table and "xEP" in table


def test_cli_balancing_dispatch(capsys):
    """``--dispatch balanced`` models the runtime's default dispatcher: FSSDP's straggler factor
    drops below the paper's dispatch on the same trace and placements (the serial schedule: its t
    from the attention alone leaves the paper dispatch something to miss)."""
    out = {}
    for mode in ("paper", "balanced"):
        assert main(["--trace", "synthetic", "--gpus", "8", "--steps", "8", "--policies", "ep,fssdp", "--no-png",
                     "--target-std", "0.08", "--tokens-per-gpu", "4096", "--dispatch", mode, "--json",
                     "--serial"]) == 0
        out[mode] = json.loads(capsys.readouterr().out)
        assert out[mode]["setup"]["dispatch"] == mode
    paper, balanced = ({r["policy"]: r for r in out[m]["results"]} for m in ("paper", "balanced"))
    assert balanced["ep"]["straggler"] == pytest.approx(paper["ep"]["straggler"])  # one holder: nothing to split
    assert balanced["fssdp"]["straggler"] < paper["fssdp"]["straggler"] - 0.02, (balanced["fssdp"], paper["fssdp"])
    assert balanced["fssdp"]["iteration_ms"] < paper["fssdp"]["iteration_ms"]


# -- cluster scale (ds_fssdp.sim.cluster) ------------------------------------------------------------


def test_a_dense_dispatcher_gives_the_compact_ones_numbers():
    """One group spanning the world: an injected dispatcher returning dense plans (converted by
    the policy) gives the compact dispatcher's numbers, a re-shard (step 8) and both modes included."""
    setup = small_setup()
    tokens = skewed_tokens(12, setup, std=0.12, seed=3)
    for paper_dispatch, compact_dispatch in ((dispatch, dispatch_plan),
                                             (functools.partial(dispatch, mode="balanced"),
                                              functools.partial(dispatch_plan, mode="balanced"))):
        want = simulate(setup, tokens, CLUSTER_POLICIES, dispatcher=paper_dispatch)
        got = simulate_cluster(setup, tokens, CLUSTER_POLICIES, dispatcher=compact_dispatch)
        assert any(r.migrated_experts for r in want), "the trace must exercise a re-shard"
        for a, b in zip(want, got):
            assert (b.policy, b.group_size) == (a.policy, 8)
            assert b.iteration_s == pytest.approx(a.iteration_s, rel=1e-12), a.policy
            assert b.breakdown_s == pytest.approx(a.breakdown_s, rel=1e-12), a.policy
            assert b.memory_bytes == pytest.approx(a.memory_bytes, rel=1e-12), a.policy
            assert (b.straggler, b.inter_node_gb, b.replicas_per_layer) == pytest.approx(
                (a.straggler, a.inter_node_gb, a.replicas_per_layer), rel=1e-12), a.policy
            assert b.migrated_experts == a.migrated_experts


def test_links_equal_the_cost_model():
    topo = Topology(num_ranks=8, ranks_per_node=4)
    cost = CostModel(HW, SHAPE, topo)
    gen = torch.Generator().manual_seed(5)
    owner = homogeneous_owner(12, 8)
    shard = shard_placement(owner, 8)
    for _ in range(10):
        p = shard | (torch.rand(12, 8, generator=gen) < 0.25)
        tokens = torch.randint(0, 50, (12, 8), generator=gen)
        plan = dispatch_plan(p, tokens, topo)
        links = plan_links(plan, 4, SHAPE.token_bytes)
        dense = plan.dense()
        assert float(links.time_B(HW)[0]) == pytest.approx(cost.a2a_time(dense), rel=1e-12)
        inter_bytes = float((dense.sum(0).double() * SHAPE.token_bytes)[~topo.same_node_DD()].sum())
        assert links.inter_total == pytest.approx(inter_bytes, rel=1e-12)
        sc = sparse_collective_links(owner.numpy(), p.numpy(), ranks_per_node=4, chunk_bytes=SHAPE.expert_bytes)
        assert float(sc.time_B(HW)[0]) == pytest.approx(cost.sparse_collective_time(owner, p), rel=1e-12)
        groups = torch.rand(3, 8, generator=gen) < 0.5
        sizes = torch.rand(3, generator=gen, dtype=torch.float64) * 1e9
        ar = allreduce_links(groups.numpy(), sizes.numpy(), ranks_per_node=4)
        assert float(ar.time_B(HW)[0]) == pytest.approx(cost.allreduce_time(groups, sizes), rel=1e-12)


def test_groups_plan_alone_and_meet_at_the_allreduce():
    """16 ranks as 2 groups of 8: each group's layers are what the group alone would run (FSSDP
    plans on its own counts), the slowest group sets the layer time, and the EDP all-reduce of
    the owners' gradients joins the dense one."""
    world = small_setup(topology=Topology(num_ranks=16, ranks_per_node=4), reshard_interval=0)
    alone = small_setup(reshard_interval=0)
    tokens = np.full((10, 2, 16, 16), 2 * world.tokens_per_gpu // 64, dtype=np.int32)  # group 0: a quarter, even
    tokens[..., 8:] = skewed_tokens(10, alone, std=0.2, seed=7)  # group 1: skewed, the straggler
    grouped = by_name(simulate_cluster(world, tokens, CLUSTER_POLICIES, group_size=8))
    for name in CLUSTER_POLICIES:
        slow = simulate_cluster(alone, tokens[..., 8:], [name])[0]
        fast = simulate_cluster(alone, tokens[..., :8], [name])[0]
        assert slow.iteration_s > fast.iteration_s, name
        for cat in ("comp", "a2a", "spag"):
            assert grouped[name].breakdown_s[cat] == pytest.approx(slow.breakdown_s[cat], rel=1e-12), (name, cat)
        ar = grouped[name].link_bytes["ar"]
        P = SHAPE.params
        owned = 2 * 2 * P  # 16 experts on 8 ranks, 2 layers
        # DeepSpeed's dense gradients over the world; over EDP rings of 2 the runtime's expert gradients,
        # or DeepSpeed's MoE's (EP, Uniform): all in DeepSpeed's communication dtype (bf16 by default)
        grad_bytes = world.grad_sync_bytes
        assert grad_bytes == 2
        per_rank = 2 * 15 / 16 * grad_bytes * world.dense_params + 2 * 1 / 2 * grad_bytes * owned
        assert ar["gpu_mean"] == pytest.approx(per_rank) and ar["gpu_max"] == pytest.approx(per_rank)
        assert grouped[name].memory_bytes["opt"] == pytest.approx(12 * (world.dense_params + owned))
    assert grouped["fssdp"].iteration_s < grouped["ep"].iteration_s
    assert grouped["fssdp"].planning_s["post_gating"] > 0 and grouped["ep"].planning_s["post_gating"] == 0


def test_memory_cap_and_group_size_checks():
    setup = small_setup(reshard_interval=0)
    tokens = skewed_tokens(8, setup, std=0.15, seed=8)
    for cap in (1.1, 1.3):
        res = by_name(simulate_cluster(setup, tokens, CLUSTER_POLICIES, group_size=4, memory_cap=cap))
        ep = sum(res["ep"].memory_bytes.values())
        assert ep == pytest.approx(res["ep"].ep_memory_bytes)
        for name in ("fssdp", "fssdp-rm"):
            r = res[name]
            assert r.budget == budget_for_cap(setup, 4, cap, rematerialize=name == "fssdp-rm") and r.budget >= 1
            assert sum(r.memory_bytes.values()) <= cap * ep * (1 + 1e-12), (name, cap)
            worst = ep + 4 * SHAPE.params * (r.budget + 1) * (2 if name == "fssdp-rm" else setup.num_layers)
            assert worst > cap * ep, "m is the largest budget within the cap"
    for bad in (3, 5, 16):
        with pytest.raises(ValueError, match=rf"group_size \({bad}\)"):
            simulate_cluster(setup, tokens, ["ep"], group_size=bad)
    with pytest.raises(ValueError, match="at cluster scale"):
        simulate_cluster(setup, tokens, ["fastermoe"], group_size=4)
    with pytest.raises(ValueError, match=r"ep: group_size \(8\) must be <= the 4 experts"):
        PolicyRun("ep", small_setup(num_experts=4), group_size=8)


def test_load_cv_source():
    for E, k, cv in ((8, 2, 0.5), (256, 8, 0.5), (256, 8, 1.5)):
        src = LoadCVSource(steps=6, num_layers=3, num_experts=E, num_ranks=16, assignments_per_rank=4096 * k, cv=cv,
                           top_k=k, seed=1)
        steps = list(src)
        assert all(t.shape == (3, E, 16) and t.dtype == np.int32 and (t.sum(1) == 4096 * k).all() for t in steps)
        assert load_cv(np.stack([t.sum(2) for t in steps])) == pytest.approx(cv, rel=0.06), (E, cv)
        again = list(LoadCVSource(steps=6, num_layers=3, num_experts=E, num_ranks=16, assignments_per_rank=4096 * k,
                                  cv=cv, top_k=k, seed=1))
        assert all((a == b).all() for a, b in zip(steps, again))
    with pytest.raises(ValueError, match=r"load_cv \(2.0\) must be in \[0, 1.732\)"):
        LoadCVSource(steps=2, num_layers=1, num_experts=8, num_ranks=2, assignments_per_rank=10, cv=2.0, top_k=2)


def test_fixed_presets():
    b = cluster_preset("b")
    ds = model_preset("deepseek-v3-671b")
    small, large = build_setup(b, ds, 64), build_setup(b, ds, 4096)
    assert small.num_experts == large.num_experts == 256 and small.num_layers == 58
    assert small.shape.params == 3 * 7168 * 2048
    # 671B in all: 58 x 256 routed experts plus the dense part (embeddings and LM head left out).
    total = 58 * 256 * small.shape.params + small.dense_params
    assert 650e9 < total + 2 * 129280 * 7168 < 690e9
    assert small.extra_compute_s > 0 and build_setup(b, model_preset("deepseek-v3"), 32).extra_compute_s == 0
    assert build_setup(b, model_preset("mixtral-8x7b"), 1024).num_experts == 8
    assert model_preset("qwen3-30b-a3b").expert_shape().params == 3 * 2048 * 768


def test_cli_1024_gpus_fixed_preset(capsys):
    """A 1,024-GPU run of a fixed preset at cluster scale: time, memory, planning and links per
    policy (mixtral-8x7b: t = 0 at 4096 tokens, so calibration on lets FSSDP replicate). The first
    two groups of each policy are simulated (``--max-groups``; a synthetic trace's groups are alike),
    the world's all-reduce over all 1,024 ranks; every group runs in
    test_groups_plan_alone_and_meet_at_the_allreduce."""
    assert main(["--trace", "synthetic", "--cluster", "b", "--model", "mixtral-8x7b", "--gpus", "1024", "--steps", "6",
                 "--group-size", "64", "--memory-cap", "1.2", "--calibration", "--max-groups", "2", "--json",
                 "--no-png"]) == 0
    out = json.loads(capsys.readouterr().out)
    res = {r["policy"]: r for r in out["results"]}
    assert set(res) == set(CLUSTER_POLICIES) and out["setup"]["gpus"] == 1024 and out["setup"]["num_experts"] == 8
    assert out["trace"]["load_cv"] == pytest.approx(0.5, rel=0.1)
    for name, r in res.items():
        assert r["group_size"] == (64 if name.startswith("fssdp") else 8)  # EP groups hold at most E = 8 ranks
        assert (r["groups"], r["groups_simulated"]) == (1024 // r["group_size"], 2)
        assert r["iteration_ms"] > 0 and r["iteration_s"] == pytest.approx(
            r["iteration_ms"] / 1e3)
        assert set(r["memory_gb"]) == {"param", "grad", "opt"} and r["memory_vs_ep"] <= 1.2 + 1e-9
        assert r["link_bytes"]["ar"]["node_max"] > 0 and r["count_allgather_ms"] > 0
        assert name in out["speedup_vs_ep"]
    assert res["fssdp"]["planning_ms"]["post_gating"] > 0

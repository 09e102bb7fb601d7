"""Placement policies behind one interface: every policy's placements are valid over many
iterations, each baseline does what the paper says it does, and FSSDP matches the planner's own
functions (place, calibrate)."""
import math

import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import (CostModel, ExpertShape, Hardware, calibrate, dispatch,
                              homogeneous_owner, place, shard_placement)
from ds_fssdp.planner.baselines import (POLICY_NAMES, PolicyConfig, balance_ratio, lpt_with_slots, make_policy,
                                        relabel_owner, uniform_tokens)

HW = Hardware(flops=100e12, intra_bw=200e9, inter_bw=25e9, latency=10e-6)
SHAPE = ExpertShape(hidden=256, ffn=1024)


def drifting_tokens(steps, L, E, D, gen, *, per_rank=400, skew=2.0):
    """[steps, L, E, D] assignments whose hot experts drift slowly."""
    z = torch.randn(L, E, generator=gen) * skew
    out = []
    for _ in range(steps):
        z = 0.9 * z + 0.45 * torch.randn(L, E, generator=gen) * skew
        probs = torch.softmax(z, 1)
        out.append(torch.stack([torch.distributions.Multinomial(per_rank, probs[l]).sample((D, )).T.long()
                                for l in range(L)]))
    return torch.stack(out)


def make_config(E, D, G, L, **kw):
    topo = Topology(num_ranks=D, ranks_per_node=G)
    base = dict(num_experts=E, num_layers=L, topology=topo, budget=2, overlap_degree=3,
                cost=CostModel(HW, SHAPE, topo), reshard_interval=4, calibration=True, smartmoe_interval=3,
                flexmoe_slots=2, flexmoe_threshold=1.1)
    base.update(kw)
    return PolicyConfig(**base)


def initial_owner(config) -> torch.Tensor:
    """long [L, E]: the expert-parallel layout (homogeneous sharding) for every layer."""
    E, L = config.num_experts, config.num_layers
    return homogeneous_owner(E, config.topology.num_ranks).expand(L, E).clone()


def run_policy(name, config, tokens_SLED, *, window=3):
    """Drive a policy through the phases like the runtime does; yield per-layer records."""
    from ds_fssdp.planner import LoadPredictor
    policy = make_policy(name, config)
    owner_LE = initial_owner(config)
    predictor = LoadPredictor([config.num_experts] * config.num_layers, window=window)
    for s in range(tokens_SLED.shape[0]):
        before_LE = owner_LE.clone()
        reshard = policy.reshard(s, predictor.predict_all(), owner_LE=owner_LE)
        if reshard is not None:
            owner_LE = reshard.owner_LE
        for l in range(config.num_layers):
            placement_ED = policy.pre_gating(l, owner_LE[l], predictor.predict(l))
            tokens_ED = policy.route(tokens_SLED[s, l])
            lp = policy.post_gating(l, owner_LE[l], placement_ED, tokens_ED=tokens_ED)
            plan_EDD = policy.dispatch(lp, tokens_ED)
            predictor.observe(l, tokens_ED.sum(1))
            yield dict(step=s, layer=l, policy=policy, owner_E=owner_LE[l], before_E=before_LE[l], reshard=reshard,
                       pre_ED=placement_ED, lp=lp, tokens_ED=tokens_ED, raw_ED=tokens_SLED[s, l], plan_EDD=plan_EDD)


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("E,D,G,L", [(8, 8, 4, 2), (16, 8, 2, 2), (6, 4, 4, 3)])
def test_every_policy_places_validly(name, E, D, G, L):
    gen = torch.Generator().manual_seed(E * 10 + D)
    config = make_config(E, D, G, L)
    tokens = drifting_tokens(10, L, E, D, gen)
    slots_D = torch.bincount(homogeneous_owner(E, D), minlength=D)
    for rec in run_policy(name, config, tokens):
        lp, owner_E, tokens_ED = rec["lp"], rec["owner_E"], rec["tokens_ED"]
        shard_ED = shard_placement(owner_E, D)
        assert bool(lp.placement_ED[shard_ED].all()), "the shard must stay in the placement"
        assert bool(lp.placement_ED.any(1).all()), "every expert needs a holder"
        parts = [lp.hidden_ED, lp.calibrated_ED, lp.shadow_ED, lp.persistent_ED]
        assert int(sum(p.long() for p in parts).max()) <= 1, "a replica is one kind only"
        assert torch.equal(parts[0] | parts[1] | parts[2] | parts[3], lp.placement_ED & ~shard_ED)
        plan = rec["plan_EDD"]
        assert torch.equal(plan.sum(2), tokens_ED), "the plan must dispatch every token"
        assert bool((plan.sum(1) > 0).le(lp.placement_ED).all()), "tokens only go to holders"
        assert torch.equal(tokens_ED.sum(0), rec["raw_ED"].sum(0)), "routing keeps each rank's token count"
        if name in ("fssdp", "fssdp-rm"):
            added_ED = lp.hidden_ED | lp.calibrated_ED
            assert int(added_ED.sum(0).max()) <= config.budget, "per-rank budget m"
            assert int(lp.hidden_ED.any(1).sum()) <= config.overlap_degree, "hidden gather: at most t experts"
            assert bool(rec["pre_ED"][lp.hidden_ED].all()) and not bool(rec["pre_ED"][lp.calibrated_ED].any())
            assert not (lp.shadow_ED.any() or lp.persistent_ED.any())
            assert lp.rematerialize == (name == "fssdp-rm")
        elif name == "fastermoe":
            shadowed_E = lp.shadow_ED.any(1)
            assert bool(lp.placement_ED[shadowed_E].all()), "a shadowed expert is on every rank"
            assert torch.equal(rec["pre_ED"], shard_ED), "FasterMoE gathers nothing before gating"
        elif name == "flexmoe":
            assert int(lp.persistent_ED.sum(0).max()) <= config.flexmoe_slots, "reserved slots per rank"
            assert torch.equal(owner_E, homogeneous_owner(E, D)), "FlexMoE never moves owners"
        else:
            assert torch.equal(lp.placement_ED, shard_ED), f"{name} places only the shard"
        if name == "smartmoe":
            assert torch.equal(torch.bincount(owner_E, minlength=D), slots_D), "SmartMoE keeps slots per rank"
        if name == "uniform":
            assert int((tokens_ED.max(0).values - tokens_ED.min(0).values).max()) <= 1, "uniform spreads evenly"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policies_are_deterministic(name):
    gen = torch.Generator().manual_seed(3)
    config = make_config(8, 8, 4, 2)
    tokens = drifting_tokens(9, 2, 8, 8, gen)
    a = [(r["lp"].placement_ED, r["plan_EDD"], r["owner_E"]) for r in run_policy(name, config, tokens)]
    b = [(r["lp"].placement_ED, r["plan_EDD"], r["owner_E"]) for r in run_policy(name, config, tokens.clone())]
    assert all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def test_reshards_move_what_changed():
    gen = torch.Generator().manual_seed(4)
    for name in ("smartmoe", "fssdp", "flexmoe"):
        config = make_config(16, 8, 4, 2)
        seen = 0
        for rec in run_policy(name, config, drifting_tokens(13, 2, 16, 8, gen)):
            r = rec["reshard"]
            if r is None or rec["layer"]:
                continue
            seen += 1
            copies = r.copies_M4
            assert copies.shape[1] == 4 and bool((copies[:, 2] != copies[:, 3]).all())
            if name == "flexmoe":
                continue  # expansions copy without moving owners
            changed = int((rec["before_E"] != rec["owner_E"]).sum())
            assert int((copies[:, 0] == 0).sum()) == changed, "one copy per expert whose owner changed"
        assert seen, f"{name} never re-sharded"


def test_fssdp_reshard_interval_and_uniform_slots():
    gen = torch.Generator().manual_seed(5)
    config = make_config(16, 8, 4, 3, reshard_interval=5)
    policy = make_policy("fssdp", config)
    owner = initial_owner(config)
    loads = torch.rand(3, 16, generator=gen) ** 3
    for step in range(12):
        r = policy.reshard(step, loads, owner_LE=owner)
        assert (r is not None) == (step in (5, 10))
        if r is not None:
            counts = torch.bincount(r.owner_LE.flatten(), minlength=8)
            assert int(counts.max() - counts.min()) == 0, "heterogeneous sharding keeps memory uniform"
            owner = r.owner_LE
    assert policy.reshard(0, loads, owner_LE=owner) is None and policy.reshard(5, None, owner_LE=owner) is None


def test_relabel_keeps_experts_in_place():
    topo = Topology(num_ranks=8, ranks_per_node=4)
    old = homogeneous_owner(16, 8).expand(2, 16).clone()
    # The same grouping with ranks renamed (node 0 <-> node 1, ranks permuted inside): nothing moves.
    perm = torch.tensor([5, 4, 7, 6, 1, 0, 3, 2])
    assert torch.equal(relabel_owner(old, perm[old], topo, keep_nodes=True), old)
    assert torch.equal(relabel_owner(old[0], perm[old[0]], topo, keep_nodes=False), old[0])


def test_smartmoe_balances_by_lpt_and_migrates_only_on_its_interval():
    load = torch.tensor([90., 80, 5, 5, 70, 60, 5, 5])  # EP pairs the hot ones
    owner = lpt_with_slots(load, torch.tensor([2, 2, 2, 2]))
    rank_load = torch.zeros(4, dtype=torch.float64).index_add_(0, owner, load.double())
    ep_load = torch.zeros(4, dtype=torch.float64).index_add_(0, homogeneous_owner(8, 4), load.double())
    assert float(rank_load.max()) < float(ep_load.max())
    assert torch.equal(torch.bincount(owner, minlength=4), torch.tensor([2, 2, 2, 2]))
    config = make_config(8, 4, 2, 1, smartmoe_interval=3)
    policy = make_policy("smartmoe", config)
    cur = initial_owner(config)
    assert policy.reshard(1, load[None], owner_LE=cur) is None
    r = policy.reshard(3, load[None], owner_LE=cur)
    assert r is not None and r.copies_M4.shape[0] > 0
    # Same loads again: the permutation is already in place, nothing migrates.
    assert policy.reshard(6, load[None], owner_LE=r.owner_LE) is None


def test_flexmoe_expands_the_hot_expert_until_threshold():
    config = make_config(8, 4, 2, 1, flexmoe_slots=2, flexmoe_threshold=1.2)
    policy = make_policy("flexmoe", config)
    owner = initial_owner(config)
    load = torch.tensor([[400., 10, 10, 10, 10, 10, 10, 10]])
    before = balance_ratio(shard_placement(owner[0], 4), load[0])
    r = policy.reshard(1, load, owner_LE=owner)
    assert r is not None and bool((r.copies_M4[:, 1] == 0).all()), "expand the hot expert"
    holders = shard_placement(owner[0], 4) | policy.persistent_ED(0, owner[0])
    assert balance_ratio(holders, load[0]) < before
    assert int(policy.persistent_ED(0, owner[0]).sum(0).max()) <= 2
    # Balanced loads: nothing to do.
    calm = make_policy("flexmoe", config)
    assert calm.reshard(1, torch.full((1, 8), 50.0), owner_LE=owner) is None


def test_fastermoe_shadows_only_when_it_pays():
    topo = Topology(num_ranks=8, ranks_per_node=4)
    owner = homogeneous_owner(8, 8)
    hot = torch.full((8, 8), 20, dtype=torch.long)
    hot[0] = 2000
    for hw, shape, expect in ((HW, SHAPE, True), (Hardware(flops=100e12, intra_bw=1e9, inter_bw=1e9),
                                                  ExpertShape(hidden=1024, ffn=65536), False)):
        config = make_config(8, 8, 4, 1, cost=CostModel(hw, shape, topo))
        lp = make_policy("fastermoe", config).post_gating(0, owner, shard_placement(owner, 8), tokens_ED=hot)
        assert bool(lp.shadow_ED[0].any()) == expect
        if expect:
            assert bool(lp.placement_ED[0].all())
    even = torch.full((8, 8), 100, dtype=torch.long)
    lp = make_policy("fastermoe", make_config(8, 8, 4, 1)).post_gating(0, owner, shard_placement(owner, 8),
                                                                         tokens_ED=even)
    assert not bool(lp.shadow_ED.any()), "balanced loads: nothing to gain"


def test_uniform_tokens_spread_evenly():
    tokens = torch.tensor([[10, 0, 7], [0, 0, 0], [5, 3, 0], [1, 2, 0]])
    out = uniform_tokens(tokens)
    assert torch.equal(out.sum(0), tokens.sum(0))
    assert int((out.max(0).values - out.min(0).values).max()) <= 1


def test_fssdp_matches_place_and_calibrate():
    """The new interface reproduces the functional API the runtime already uses."""
    gen = torch.Generator().manual_seed(6)
    topo = Topology(num_ranks=8, ranks_per_node=4)
    for _ in range(20):
        owner = torch.randint(0, 8, (12, ), generator=gen)
        load = torch.rand(12, generator=gen) ** 3 * 1000
        t, m = int(torch.randint(1, 6, (1, ), generator=gen)), int(torch.randint(1, 4, (1, ), generator=gen))
        config = make_config(12, 8, 4, 1, overlap_degree=t, budget=m,
                             calibration_latency_budget=float(torch.rand(1, generator=gen)) * 1e-3)
        fssdp, ep = make_policy("fssdp", config), make_policy("ep", config)
        pre = fssdp.pre_gating(0, owner, load)
        assert torch.equal(pre, place(owner, load, topo, placement="paper", overlap_degree=t, budget=m))
        assert torch.equal(ep.pre_gating(0, owner, load), shard_placement(owner, 8))
        tokens = torch.distributions.Multinomial(300, torch.rand(12, generator=gen) ** 4 + 0.01).sample((8, )).T.long()
        want = calibrate(owner, pre, tokens, topo, config.cost, overlap_degree=fssdp.calibration_overlap_degree(),
                         budget=m, latency_budget=config.calibration_latency_budget, dispatcher=dispatch)
        lp = fssdp.post_gating(0, owner, pre, tokens_ED=tokens)
        assert torch.equal(lp.placement_ED, want.placement_ED)
        assert int(lp.calibrated_ED.sum()) == want.added_pairs


def test_calibration_overlap_degree_follows_the_latency_budget():
    config = make_config(16, 8, 4, 1, overlap_degree=2, calibration_latency_budget=math.inf)
    assert make_policy("fssdp", config).calibration_overlap_degree() == 16
    psi_time = SHAPE.expert_bytes / HW.inter_bw
    config = make_config(16, 8, 4, 1, overlap_degree=2, calibration_latency_budget=3.5 * psi_time)
    assert make_policy("fssdp", config).calibration_overlap_degree() == 2 + 3


def test_errors_name_the_values():
    topo = Topology(num_ranks=4, ranks_per_node=2)
    with pytest.raises(ValueError, match=r"'nope'"):
        make_policy("nope", PolicyConfig(num_experts=4, num_layers=1, topology=topo))
    with pytest.raises(ValueError, match=r"budget \(-1\)"):
        PolicyConfig(num_experts=4, num_layers=1, topology=topo, budget=-1)
    with pytest.raises(ValueError, match=r"flexmoe_threshold \(0.5\)"):
        PolicyConfig(num_experts=4, num_layers=1, topology=topo, flexmoe_threshold=0.5)
    config = PolicyConfig(num_experts=4, num_layers=1, topology=topo)
    owner = homogeneous_owner(4, 4)
    with pytest.raises(ValueError, match="fastermoe: shadowing needs PolicyConfig.cost"):
        make_policy("fastermoe", config).post_gating(0, owner, shard_placement(owner, 4),
                                                     tokens_ED=torch.ones(4, 4, dtype=torch.long))

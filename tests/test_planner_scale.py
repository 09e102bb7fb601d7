"""Algorithm 2 (heterogeneous sharding), calibration, the cost model and the "auto" knobs."""
import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import (CostModel, ExpertShape, Hardware, auto_materialization_budget, auto_overlap_degree,
                              calibrate, dispatch, heterogeneous_sharding, homogeneous_owner, materialize,
                              shard_placement)

HW = Hardware(flops=100e12, intra_bw=300e9, inter_bw=50e9, latency=10e-6)
SHAPE = ExpertShape(hidden=1024, ffn=4096)


def skewed_loads(L, E, gen, strength=2.0):
    return torch.softmax(torch.randn(L, E, generator=gen) * strength, 1) * 10_000


@pytest.mark.parametrize("L,E,D,G,t", [(4, 8, 8, 4, 2), (3, 16, 8, 2, 4), (2, 6, 4, 2, 1), (5, 8, 16, 4, 3),
                                       (3, 5, 4, 2, 2)])
def test_heterogeneous_sharding_invariants(L, E, D, G, t):
    gen = torch.Generator().manual_seed(L * 100 + E)
    topo = Topology(num_ranks=D, ranks_per_node=G)
    for _ in range(10):
        load = skewed_loads(L, E, gen)
        owner = heterogeneous_sharding(load, topo, overlap_degree=t)
        assert owner.shape == (L, E) and owner.dtype == torch.long
        assert bool(((owner >= 0) & (owner < D)).all()), "every expert of every layer has one owner"
        slots = torch.bincount(owner.flatten(), minlength=D)
        assert int(slots.max() - slots.min()) <= (0 if (L * E) % D == 0 else 1), "memory must stay uniform"
        assert torch.equal(owner, heterogeneous_sharding(load.clone(), topo, overlap_degree=t))


def test_heterogeneous_sharding_spreads_cold_experts_over_nodes():
    """The heaviest node's share of a layer's underloaded load is lower than with even sharding."""
    gen = torch.Generator().manual_seed(5)
    topo = Topology(num_ranks=8, ranks_per_node=4)
    L, E, t = 4, 16, 4
    homo_worse, het_worse = [], []
    for _ in range(20):
        load = skewed_loads(L, E, gen, strength=1.5)
        owner = heterogeneous_sharding(load, topo, overlap_degree=t)
        homo = homogeneous_owner(E, 8).expand(L, E)
        cold = torch.ones(L, E, dtype=torch.bool)
        cold.scatter_(1, torch.sort(-load, dim=1, stable=True).indices[:, :t], False)
        for o, acc in ((owner, het_worse), (homo, homo_worse)):
            node = o // 4
            node_cold = torch.zeros(L, 2, dtype=torch.float64).scatter_add_(1, node, (load * cold).double())
            acc.append(float((node_cold.max(1).values / node_cold.sum(1)).mean()))
    assert sum(het_worse) / len(het_worse) < sum(homo_worse) / len(homo_worse)
    assert max(het_worse) < 0.6


def test_heterogeneous_sharding_uneven_slots():
    owner = heterogeneous_sharding(torch.rand(3, 5), Topology(num_ranks=4, ranks_per_node=2), overlap_degree=1)
    assert sorted(torch.bincount(owner.flatten(), minlength=4).tolist()) == [3, 4, 4, 4]


def test_cost_model_basics():
    topo = Topology(num_ranks=4, ranks_per_node=2)
    cost = CostModel(HW, SHAPE, topo)
    assert SHAPE.expert_bytes == 2 * 1024 * 4096 * 2
    rows = torch.tensor([100, 0, 0, 0])
    assert float(cost.compute_time_D(rows)[0]) == pytest.approx(3 * 100 * 2 * SHAPE.params / HW.flops)
    owner = homogeneous_owner(4, 4)
    shard = shard_placement(owner, 4)
    assert cost.gather_time(owner, shard) == 0.0
    # One replica of expert 0 on rank 1 (same node): one chunk over rank 1's intra link.
    p = shard.clone()
    p[0, 1] = True
    assert cost.gather_time(owner, p) == pytest.approx(HW.latency + SHAPE.expert_bytes / HW.intra_bw)
    # Expert 0 on both ranks of node 1: it crosses the inter-node link once.
    p = shard.clone()
    p[0, 2:] = True
    want = HW.latency + max(SHAPE.expert_bytes / HW.inter_bw, SHAPE.expert_bytes / HW.intra_bw)
    assert cost.gather_time(owner, p) == pytest.approx(want)
    # Token exchange: rank 0 sends 10 rows to rank 2 (other node).
    plan = torch.zeros(4, 4, 4, dtype=torch.long)
    plan[2, 0, 2] = 10
    assert cost.a2a_time(plan) == pytest.approx(HW.latency + 10 * SHAPE.token_bytes / HW.inter_bw)


def test_calibration_accepts_when_cheap_and_rejects_when_not():
    topo = Topology(num_ranks=4, ranks_per_node=4)
    owner = homogeneous_owner(4, 4)
    predicted = shard_placement(owner, 4)  # the prediction saw no skew
    tokens = torch.tensor([[4000] * 4, [10] * 4, [10] * 4, [10] * 4])  # expert 0 is hot in reality
    fast = CostModel(HW, SHAPE, topo)
    cal = calibrate(owner, predicted, tokens, topo, fast, overlap_degree=2, budget=1, latency_budget=1.0)
    assert cal.accepted and cal.added_pairs > 0 and cal.saved_s > cal.extra_s
    assert bool(cal.placement_ED[shard_placement(owner, 4)].all())
    # Huge experts on slow links: the extra gather costs more than the compute and token traffic
    # it saves.
    slow = CostModel(Hardware(flops=100e12, intra_bw=1e9, inter_bw=1e9), ExpertShape(hidden=1024, ffn=65536), topo)
    cal = calibrate(owner, predicted, tokens, topo, slow, overlap_degree=2, budget=1, latency_budget=1e9)
    assert not cal.accepted and torch.equal(cal.placement_ED, predicted) and cal.extra_s > cal.saved_s
    # Worth it, but over the latency budget.
    cal = calibrate(owner, predicted, tokens, topo, fast, overlap_degree=2, budget=1, latency_budget=1e-9)
    assert not cal.accepted
    # Nothing left to add: the budget is spent.
    full = materialize(owner, tokens.sum(1), topo, overlap_degree=2, budget=1)
    cal = calibrate(owner, full, tokens, topo, fast, overlap_degree=2, budget=1, latency_budget=1.0)
    assert not cal.accepted and cal.added_pairs == 0


def test_calibration_fits_its_latency_budget_with_fewer_experts():
    """When the merge's extra gather is over the latency budget, a merge of fewer distinct experts
    that fits (and pays) is adopted instead of none."""
    topo = Topology(num_ranks=4, ranks_per_node=4)
    owner = homogeneous_owner(8, 4)
    predicted = shard_placement(owner, 4)
    tokens = torch.tensor([[3000] * 4, [2500] * 4, [2000] * 4, [1500] * 4] + [[10] * 4] * 4)
    cost = CostModel(HW, SHAPE, topo)
    shard = shard_placement(owner, 4)

    def merge(t):
        merged = materialize(owner, tokens.sum(1), topo, overlap_degree=t, budget=2, base_ED=predicted)
        return merged, cost.gather_time(owner, shard | (merged & ~predicted))

    (_, wide), (small, narrow) = merge(4), merge(1)
    assert narrow < wide
    budget = 0.5 * (narrow + wide)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["overlap_degree"])
        return materialize(*args, **kwargs)

    cal = calibrate(owner, predicted, tokens, topo, cost, overlap_degree=4, budget=2, latency_budget=budget,
                    materializer=counted)
    assert cal.accepted and 1 <= cal.overlap_degree < 4 and cal.extra_s <= budget
    merged, extra = merge(cal.overlap_degree)
    assert torch.equal(cal.placement_ED, merged) and cal.extra_s == extra and cal.saved_s > extra
    assert cal.added_pairs == int((merged & ~predicted).sum()) > 0
    # Bisection: the full merge, then at most ceil(log2 4) smaller ones (t 2 is over the budget too);
    # then the same for the evicting candidate (on the shard there is nothing to evict).
    assert calls == [4, 2, 1] * 2 and merge(2)[1] > budget
    # None fits: refused, the placement unchanged.
    cal = calibrate(owner, predicted, tokens, topo, cost, overlap_degree=4, budget=2, latency_budget=0.5 * narrow)
    assert not cal.accepted and torch.equal(cal.placement_ED, predicted) and cal.added_pairs == 0


def test_auto_knobs():
    assert auto_overlap_degree(attention_seconds=1e-3, bandwidth=50e9, expert_bytes=10_000_000) == 5
    assert auto_overlap_degree(attention_seconds=0.0, bandwidth=50e9, expert_bytes=10) == 0
    with pytest.raises(ValueError, match="bandwidth"):
        auto_overlap_degree(attention_seconds=1.0, bandwidth=0, expert_bytes=10)
    assert auto_materialization_budget(memory_bytes=800, expert_bytes=10, num_layers=4, rematerialize=False) == 10
    assert auto_materialization_budget(memory_bytes=800, expert_bytes=10, num_layers=4, rematerialize=True) == 20

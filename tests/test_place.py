"""planner.place (the one pre-gating entry point) and the cost-aware placement: invariants, C equal
to the Python reference, and instances whose best answer is known."""
import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import (CostModel, ExpertShape, Hardware, LoadPredictor, PlacementOptions, homogeneous_owner,
                              materialize, place, place_predicted, shard_placement)
from ds_fssdp.planner.cost_place import MAX_MARGIN, Coefficients, cost_materialize, cost_materialize_reference
from ds_fssdp.planner.joint import joint_materialize

# (E, D, ranks per node); the last is one node, where the levels are filled once
SHAPES = [(8, 8, 4), (16, 8, 2), (64, 32, 8), (6, 4, 2), (4, 8, 4), (12, 6, 3), (3, 2, 1), (20, 12, 4), (10, 10, 1), (16, 8, 8)]
# replicas free inside a window of 100 chunks
CHEAP = Coefficients(row=1e-6, intra=1e-8, inter=1e-7, chunk_intra=1e-6, chunk_inter=3e-6, window=1e-4)


def _instance(gen, E, D, total):
    share = torch.softmax(torch.randn(E, generator=gen) * 1.5, 0)
    return torch.distributions.Multinomial(total_count=total, probs=share).sample((D, )).t().double()


def test_cost_placement_invariants_and_c_equals_reference():
    gen = torch.Generator().manual_seed(0)
    for i in range(50):  # five instances of each shape
        E, D, G = SHAPES[i % len(SHAPES)]
        topo = Topology(num_ranks=D, ranks_per_node=G)
        owner = homogeneous_owner(E, D) if i % 2 else torch.randint(0, D, (E, ), generator=gen)
        tokens = _instance(gen, E, D, int(torch.randint(1, 3000, (1, ), generator=gen)))
        if i % 3 == 0:
            tokens = tokens / 3.0  # window means are fractional
        t = int(torch.randint(0, E + 2, (1, ), generator=gen))
        m = int(torch.randint(0, 5, (1, ), generator=gen))
        r = torch.rand(6, generator=gen, dtype=torch.float64).tolist()
        c = Coefficients(row=1e-6 * (0.1 + r[0]), intra=1e-7 * r[1], inter=1e-6 * r[2], chunk_intra=1e-4 * r[3],
                         chunk_inter=3e-4 * r[4], window=3e-4 * r[5])
        margin = (0.0, 0.15, 0.4)[i % 3]
        p = cost_materialize(owner, tokens, topo, overlap_degree=t, budget=m, coefficients=c, margin=margin)
        assert torch.equal(p, cost_materialize_reference(owner, tokens, topo, overlap_degree=t, budget=m,
                                                         coefficients=c, margin=margin)), (i, E, D, G, t, m)
        shard = shard_placement(owner, D)
        added = p & ~shard
        assert bool(p[shard].all())
        assert int(added.sum(0).max()) <= m
        assert int(added.any(1).sum()) <= min(t, E)
        assert torch.equal(p, cost_materialize(owner, tokens.clone(), topo, overlap_degree=t, budget=m,
                                               coefficients=c, margin=margin))


def test_balanced_loads_get_no_replicas():
    """With an exact prediction (margin 0) nothing pays; with a measured error, a hedge: every rank's
    owned rows can be moved in part (a replica of one of its experts), unless the replicas'
    exposed transfer costs more than the rows the hedge could move."""
    topo = Topology(num_ranks=8, ranks_per_node=4)
    owner = homogeneous_owner(16, 8)
    tokens = torch.full((16, 8), 25.0)
    free = Coefficients(row=1e-6, intra=0.0, inter=0.0, chunk_intra=0.0, chunk_inter=0.0, window=0.0)
    shard = shard_placement(owner, 8)
    for c in (CHEAP, free):
        p = cost_materialize(owner, tokens, topo, overlap_degree=16, budget=4, coefficients=c, margin=0.0)
        assert torch.equal(p, shard)
        for margin in (0.05, 0.15):
            p = cost_materialize(owner, tokens, topo, overlap_degree=16, budget=4, coefficients=c, margin=margin)
            replicated_E = (p & ~shard).any(1)
            assert all(bool(replicated_E[owner == d].any()) for d in range(8)), p
    dear = Coefficients(row=1e-6, intra=1e-8, inter=1e-7, chunk_intra=1.0, chunk_inter=1.0, window=0.0)
    p = cost_materialize(owner, tokens, topo, overlap_degree=16, budget=4, coefficients=dear, margin=0.15)
    assert torch.equal(p, shard)


def test_one_hot_expert_on_two_ranks_gets_exactly_the_replica_that_balances_it():
    topo = Topology(num_ranks=2, ranks_per_node=2)
    owner = torch.tensor([0, 1])
    tokens = torch.tensor([[300.0, 300.0], [20.0, 20.0]])  # rank 0 computes 600 rows, rank 1 40
    p = cost_materialize(owner, tokens, topo, overlap_degree=2, budget=2, coefficients=CHEAP)
    assert p.tolist() == [[True, True], [False, True]]
    # A replica whose transfer, past the window, costs more than the time it saves is not added;
    # nor without a slot or t.
    dear = Coefficients(row=1e-6, intra=1e-8, inter=1e-7, chunk_intra=1.0, chunk_inter=1.0, window=1e-3)
    for kwargs in ({"coefficients": dear, "budget": 2, "overlap_degree": 2},
                   {"coefficients": CHEAP, "budget": 0, "overlap_degree": 2},
                   {"coefficients": CHEAP, "budget": 2, "overlap_degree": 0}):
        assert torch.equal(cost_materialize(owner, tokens, topo, **kwargs), shard_placement(owner, 2))


def test_one_hot_expert_gets_as_many_holders_as_pay():
    """Expert 0 carries about 4x a rank's fair share on 4 ranks: 3 replicas balance it; the fourth
    rank (its owner) keeps the rest. When the window hides one chunk per link and each further one
    costs more than a third of the compute it saves, fewer are bought."""
    topo = Topology(num_ranks=4, ranks_per_node=4)
    owner = torch.arange(4)
    tokens = torch.tensor([[100.0] * 4, [1.0] * 4, [1.0] * 4, [1.0] * 4])
    p = cost_materialize(owner, tokens, topo, overlap_degree=4, budget=1, coefficients=CHEAP)
    assert p[0].all() and int((p & ~shard_placement(owner, 4)).sum()) == 3
    # 403 rows: EP's slowest rank computes 400, balanced ~101. The owner sends every chunk: with a
    # window of one chunk, k replicas expose (k - 1) + (k - 2)+ chunks of 60 row-times each.
    c = Coefficients(row=1.0, intra=0.0, inter=0.0, chunk_intra=60.0, chunk_inter=60.0, window=60.0)
    p = cost_materialize(owner, tokens, topo, overlap_degree=4, budget=1, coefficients=c, margin=0.0)
    added = int((p & ~shard_placement(owner, 4)).sum())
    assert 0 < added < 3, p


def test_place_dispatches_by_setting():
    topo = Topology(num_ranks=8, ranks_per_node=4)
    owner = homogeneous_owner(16, 8)
    tokens = _instance(torch.Generator().manual_seed(3), 16, 8, 4000)
    cost = CostModel(Hardware(flops=1e12, intra_bw=1e11, inter_bw=2e10), ExpertShape(hidden=64, ffn=256), topo)
    opts = lambda **kw: PlacementOptions(**{"overlap_degree": 4, "materialization_budget": 2, **kw})
    shard = shard_placement(owner, 8)
    assert torch.equal(place(owner, None, topo, config=opts()), shard)
    assert torch.equal(place(owner, tokens, topo, config=opts(policy="ep")), shard)
    assert torch.equal(place(owner, tokens, topo, config=opts(policy="fastermoe")), shard)
    joint = joint_materialize(owner, tokens, topo, overlap_degree=4, budget=2)
    assert torch.equal(place(owner, tokens, topo, config=opts(placement="joint"), cost=cost), joint)
    assert torch.equal(place(owner, tokens, topo, config=opts(placement="cost")), joint)  # no cost model
    want = cost_materialize(owner, tokens, topo, overlap_degree=4, budget=2,
                            coefficients=Coefficients.from_cost(cost, 4))
    assert torch.equal(place(owner, tokens, topo, config=opts(placement="cost"), cost=cost), want)
    coefficients = Coefficients.from_cost(cost, 4)
    for margin, used in ((0.0, 0.0), (0.4, 0.4), (5.0, MAX_MARGIN)):
        want = cost_materialize(owner, tokens, topo, overlap_degree=4, budget=2, coefficients=coefficients,
                                margin=used)
        assert torch.equal(place(owner, tokens, topo, config=opts(placement="cost"), cost=cost, margin=margin), want)
    with pytest.raises(ValueError, match="margin"):
        place(owner, tokens, topo, config=opts(placement="cost"), cost=cost, margin=-0.1)
    # place_predicted: the predictor's window mean, with its measured error as the margin.
    predictor = LoadPredictor(16, window=2)
    for k in range(3):
        predictor.observe(0, _instance(torch.Generator().manual_seed(10 + k), 16, 8, 4000))
    assert predictor.error(0) > 0.0
    want = place(owner, predictor.predict_tokens(0), topo, config=opts(placement="cost"), cost=cost,
                 margin=predictor.error(0))
    assert torch.equal(place_predicted(predictor, 0, owner, topo, config=opts(placement="cost"), cost=cost), want)
    assert not torch.equal(want, place(owner, predictor.predict_tokens(0), topo, config=opts(placement="cost"),
                                       cost=cost))  # (the margin matters here)
    alg1 = materialize(owner, tokens.sum(1), topo, overlap_degree=4, budget=2)
    assert torch.equal(place(owner, tokens, topo, config=opts(placement="paper")), alg1)
    assert torch.equal(place(owner, tokens.sum(1), topo, config=opts(placement="joint")), alg1)  # loads only
    with pytest.raises(ValueError, match="overlap_degree"):
        place(owner, tokens, topo, config=opts(overlap_degree="auto"))
    with pytest.raises(ValueError, match="placement"):
        place(owner, tokens, topo, config=opts(placement="best"))


def test_cost_placement_rejects_bad_tokens():
    topo = Topology(num_ranks=2, ranks_per_node=2)
    for bad in (float("nan"), float("inf"), -1.0):
        tokens = torch.tensor([[1.0, bad], [1.0, 1.0]])
        for fn in (cost_materialize, cost_materialize_reference):
            with pytest.raises(ValueError, match="tokens_ED"):
                fn(torch.tensor([0, 1]), tokens, topo, overlap_degree=2, budget=1, coefficients=CHEAP)


def test_a_replica_that_only_saves_exchange_is_bought_only_when_that_pays():
    """4 ranks in 2 nodes, compute balanced within 1% (no level below the slowest rank is tried
    without a margin); experts 0 and 1 (owned in node 0) are produced only in node 1, whose ranks
    have one row of room: a holder there keeps a row off the node link. Bought when a row over
    that link costs ten rows computed; not when the link is nearly free."""
    topo = Topology(num_ranks=4, ranks_per_node=2)
    owner = torch.tensor([0, 1, 2, 3])
    tokens = torch.tensor([[0.0, 0.0, 50.0, 50.0], [0.0, 0.0, 50.0, 50.0], [24.75] * 4, [24.75] * 4])
    dear = Coefficients(row=1.0, intra=0.0, inter=10.0, chunk_intra=1.0, chunk_inter=1.0, window=10.0)
    p = cost_materialize(owner, tokens, topo, overlap_degree=4, budget=1, coefficients=dear, margin=0.0)
    assert bool(p[0, 2:].any()) and bool(p[1, 2:].any()), p
    cheap = Coefficients(row=1.0, intra=0.0, inter=1e-6, chunk_intra=1.0, chunk_inter=1.0, window=10.0)
    p = cost_materialize(owner, tokens, topo, overlap_degree=4, budget=1, coefficients=cheap, margin=0.0)
    assert torch.equal(p, shard_placement(owner, 4)), p


def test_a_rank_gets_a_replica_of_its_own_tokens_when_keeping_them_home_pays():
    """One node of 2 ranks. Rank 0 computes 100 rows (experts 0 and 2), rank 1 96 (expert 1): no
    level pays, but rank 1 produces 50 tokens of expert 0 and has 4 rows of room below the slowest
    rank: a replica there keeps 4 rows off the rank link. Bought when a row over the link costs
    as much as a row computed; not when the link is cheap, nor without the window to hide it."""
    topo = Topology(num_ranks=2, ranks_per_node=2)
    owner = torch.tensor([0, 1, 0])
    tokens = torch.tensor([[10.0, 50.0], [0.0, 96.0], [40.0, 0.0]])
    dear_link = Coefficients(row=1e-6, intra=1e-6, inter=1e-6, chunk_intra=1e-6, chunk_inter=1e-6, window=1e-4)
    p = cost_materialize(owner, tokens, topo, overlap_degree=3, budget=1, coefficients=dear_link, margin=0.0)
    assert p.tolist() == [[True, True], [False, True], [True, False]]
    assert torch.equal(p, cost_materialize_reference(owner, tokens, topo, overlap_degree=3, budget=1,
                                                     coefficients=dear_link, margin=0.0))
    unhidden = Coefficients(row=1e-6, intra=1e-6, inter=1e-6, chunk_intra=1e-3, chunk_inter=1e-3, window=1e-4)
    for c in (CHEAP, unhidden):
        p = cost_materialize(owner, tokens, topo, overlap_degree=3, budget=1, coefficients=c, margin=0.0)
        assert torch.equal(p, shard_placement(owner, 2)), (c, p)

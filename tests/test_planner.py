"""Planner invariants on many random instances: Algorithm 1 (materialize), Algorithm 3 (dispatch),
the gather layout, the load predictor; and better balance than EP on skewed loads."""
import math

import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import (LoadPredictor, PolicyConfig, dispatch, gather_layout, homogeneous_owner, make_policy,
                              materialize, shard_placement, straggler_factor)

SHAPES = [(8, 8, 4), (8, 4, 2), (16, 8, 4), (4, 8, 2), (6, 4, 4), (32, 16, 4), (5, 3, 1), (3, 6, 3)]  # E, D, G


def instances(n_per_shape=25):
    gen = torch.Generator().manual_seed(0)
    for E, D, G in SHAPES:
        for i in range(n_per_shape):
            owner_E = torch.randint(0, D, (E, ), generator=gen) if i % 2 else homogeneous_owner(E, D)
            skew = torch.rand(E, generator=gen).pow(4 * torch.rand(1, generator=gen).item() + 0.5)
            load_E = skew / skew.sum() * 1000
            t = int(torch.randint(0, E + 2, (1, ), generator=gen))
            m = int(torch.randint(0, 4, (1, ), generator=gen))
            tokens_ED = torch.distributions.Multinomial(total_count=200, probs=load_E / load_E.sum()).sample(
                (D, )).t().long()
            yield E, D, Topology(num_ranks=D, ranks_per_node=G), owner_E, load_E, t, m, tokens_ED


def test_materialize_invariants():
    for E, D, topo, owner_E, load_E, t, m, _ in instances():
        p = materialize(owner_E, load_E, topo, overlap_degree=t, budget=m)
        shard = shard_placement(owner_E, D)
        assert p.dtype == torch.bool and p.shape == (E, D)
        assert bool(p[shard].all()), "the shard must stay inside the placement"
        added = p & ~shard
        assert int(added.sum(0).max()) <= min(m, t, E), "per-rank added replicas exceed the budget"
        replicated = added.any(1)
        assert int(replicated.sum()) <= min(t, E), "more distinct replicated experts than the overlap degree"
        if replicated.any():
            # Only top-t experts by load are replicated (ties by lower id).
            top = torch.sort(-load_E.double(), stable=True).indices[:min(t, E)]
            assert set(torch.nonzero(replicated).flatten().tolist()) <= set(top.tolist())
        again = materialize(owner_E.clone(), load_E.clone(), topo, overlap_degree=t, budget=m)
        assert torch.equal(p, again), "not deterministic"


def test_materialize_t_le_m_replicates_top_t_everywhere():
    topo = Topology(num_ranks=4, ranks_per_node=2)
    owner_E = homogeneous_owner(8, 4)
    load_E = torch.tensor([1., 9, 2, 3, 8, 1, 1, 1])
    p = materialize(owner_E, load_E, topo, overlap_degree=2, budget=3)
    assert bool(p[[1, 4]].all())
    assert torch.equal(p[[0, 2, 3, 5, 6, 7]], shard_placement(owner_E, 4)[[0, 2, 3, 5, 6, 7]])


def test_materialize_prefers_nodes_lacking_the_expert():
    # Expert 0 lives on node 0 (rank 0); t = m = 1 would replicate it everywhere, so use t = 2,
    # m = 1: 4 slots, expert 0 takes round(4 * 30 / 40) = 3 of them: node 1 first (ranks 2, 3 tie
    # on free slots and load: lower id), then node 1's other rank and node 0's rank 1.
    topo = Topology(num_ranks=4, ranks_per_node=2)
    owner_E = homogeneous_owner(4, 4)
    p = materialize(owner_E, torch.tensor([30., 10, 0, 0]), topo, overlap_degree=2, budget=1)
    added = p & ~shard_placement(owner_E, 4)
    assert added[0].tolist() == [False, True, True, True]
    assert added[1].tolist() == [True, False, False, False]  # the one slot left is rank 0's
    p = materialize(owner_E, torch.tensor([30., 30, 0, 0]), topo, overlap_degree=2, budget=1)
    added = p & ~shard_placement(owner_E, 4)
    # Two slots each. Expert 0 (rank 0, node 0): node 1 first (rank 2), then the least loaded
    # rank with a free slot (rank 3). Expert 1: only rank 0 has a slot left.
    assert torch.nonzero(added).tolist() == [[0, 2], [0, 3], [1, 0]]


def test_materialize_no_history_or_no_budget_is_the_shard():
    topo = Topology(num_ranks=4, ranks_per_node=4)
    owner_E = homogeneous_owner(8, 4)
    shard = shard_placement(owner_E, 4)
    config = PolicyConfig(num_experts=8, num_layers=1, topology=topo, overlap_degree=4, budget=2)
    assert torch.equal(make_policy("fssdp", config).pre_gating(0, owner_E, None), shard)
    assert torch.equal(make_policy("ep", config).pre_gating(0, owner_E, torch.rand(8)), shard)
    assert torch.equal(materialize(owner_E, torch.rand(8), topo, overlap_degree=4, budget=0), shard)
    with pytest.raises(ValueError, match="policy"):
        make_policy("nope", config)


def test_dispatch_invariants():
    for E, D, topo, owner_E, load_E, t, m, tokens_ED in instances():
        p = materialize(owner_E, load_E, topo, overlap_degree=t, budget=m)
        plan = dispatch(p, tokens_ED, topo)
        assert plan.shape == (E, D, D) and plan.dtype == torch.long and bool((plan >= 0).all())
        assert torch.equal(plan.sum(2), tokens_ED), "tokens not conserved"
        assert bool((plan.sum(1)[~p] == 0).all()), "tokens sent to a rank without the expert"
        same_node = topo.same_node_DD()
        for e in range(E):
            for d in range(D):
                c = int(tokens_ED[e, d])
                if p[e, d]:
                    assert int(plan[e, d, d]) == c, "local holder must keep its tokens"
                    continue
                local = p[e] & same_node[d]
                targets = local if local.any() else p[e]
                assert bool((plan[e, d][~targets] == 0).all()), "same-node holders must be preferred"
                shares = plan[e, d][targets]
                assert int(shares.max() - shares.min()) <= 1, "split is not even"
        assert torch.equal(plan, dispatch(p.clone(), tokens_ED.clone(), topo)), "not deterministic"


def test_fssdp_balances_better_than_ep_on_skewed_loads():
    gen = torch.Generator().manual_seed(1)
    topo = Topology(num_ranks=8, ranks_per_node=4)
    owner_E = homogeneous_owner(8, 8)
    ep, fs = [], []
    for _ in range(50):
        share_E = torch.softmax(torch.randn(8, generator=gen) * 1.5, 0)
        tokens_ED = torch.distributions.Multinomial(total_count=512, probs=share_E).sample((8, )).t().long()
        load_E = tokens_ED.sum(1).double()
        ep.append(straggler_factor(dispatch(shard_placement(owner_E, 8), tokens_ED, topo)))
        placement = materialize(owner_E, load_E, topo, overlap_degree=4, budget=2)
        fs.append(straggler_factor(dispatch(placement, tokens_ED, topo)))
    ep_mean, fs_mean = sum(ep) / len(ep), sum(fs) / len(fs)
    assert fs_mean < 0.8 * ep_mean, (fs_mean, ep_mean)
    assert all(f <= e + 1e-9 for f, e in zip(fs, ep))


def simulate_gather(owner_E, layouts):
    """Run every rank's phases on expert ids instead of rows: what lands in each replica row."""
    D = len(layouts)
    replicas = [torch.full((l.replica_E.numel(), ), -1) for l in layouts]
    for p in range(len(layouts[0].phases)):
        sent = {}
        for src, l in enumerate(layouts):
            ph = l.phases[p]
            rows = (replicas[src] if ph.from_replicas else l.owned_E)[ph.send_rows]
            offs = 0
            for dst in range(D):
                sent[(src, dst)] = rows[offs:offs + ph.send_splits[dst]]
                offs += ph.send_splits[dst]
        for dst, l in enumerate(layouts):
            ph = l.phases[p]
            got = torch.cat([sent[(src, dst)] for src in range(D)])
            assert got.numel() == sum(ph.recv_splits)
            replicas[dst][ph.recv_rows] = got
    return replicas


@pytest.mark.parametrize("hierarchical", [False, True])
def test_gather_layout_delivers_every_replica_once(hierarchical):
    for E, D, topo, owner_E, load_E, t, m, _ in instances(8):
        p = materialize(owner_E, load_E, topo, overlap_degree=t, budget=m)
        layouts = [gather_layout(owner_E, p, r, topology=topo, hierarchical=hierarchical) for r in range(D)]
        added = int(p.sum()) - E
        assert all(l.added_pairs == added for l in layouts)
        sends = sum(sum(ph.send_splits) for l in layouts for ph in l.phases)
        assert sends == added, "each added replica receives its chunk exactly once (Eq. 4)"
        for ph in range(len(layouts[0].phases)):
            for src in range(D):
                for dst in range(D):
                    assert layouts[src].phases[ph].send_splits[dst] == layouts[dst].phases[ph].recv_splits[src]
        for r, (l, got) in enumerate(zip(layouts, simulate_gather(owner_E, layouts))):
            assert torch.equal(l.owned_E, torch.nonzero(owner_E == r).flatten())
            assert torch.equal(got, l.replica_E), "a replica row holds the wrong expert"
            assert sorted(l.local_E.tolist()) == torch.nonzero(p[:, r]).flatten().tolist()
        if hierarchical and topo.num_nodes > 1:
            # Inter-node transfers: one per (expert, node it newly enters).
            node = topo.node_D()
            entered = sum(len({int(node[d]) for d in torch.nonzero(p[e]).flatten().tolist()} - {int(node[owner_E[e]])})
                          for e in range(E))
            assert layouts[0].inter_pairs == entered
    with pytest.raises(ValueError, match="shard"):
        gather_layout(torch.tensor([0, 1]), torch.tensor([[False, True], [False, True]]), 0)


def test_load_predictor_window_mean():
    pred = LoadPredictor([3, 2], window=2)
    assert pred.predict(0) is None and pred.predict_all() is None
    pred.observe(0, torch.tensor([1, 2, 3]))
    pred.observe(0, torch.tensor([3, 2, 1]))
    pred.observe(0, torch.tensor([5, 2, 1]))
    assert torch.equal(pred.predict(0), torch.tensor([4., 2., 1.], dtype=torch.float64))
    with pytest.raises(ValueError, match="expected 2"):
        pred.observe(1, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="window"):
        LoadPredictor(4, window=0)
    state = pred.state_dict()
    other = LoadPredictor([3, 2], window=2)
    other.load_state_dict(state)
    assert torch.equal(other.predict(0), pred.predict(0))


def test_load_predictor_measures_its_own_error():
    pred = LoadPredictor([3, 2], window=2)
    assert pred.error(0) is None
    pred.observe(0, torch.tensor([1, 2, 3]))
    assert pred.error(0) is None  # nothing was predicted for the first observation
    pred.observe(0, torch.tensor([3, 2, 1]))  # predicted [1, 2, 3]: |2| + 0 + |2| over 6
    assert pred.error(0) == pytest.approx(4 / 6)
    pred.observe(0, torch.tensor([2, 2, 2]))  # predicted [2, 2, 2]: exact
    assert pred.error(0) == pytest.approx(2 / 6)
    pred.observe(0, torch.tensor([0, 0, 0]))  # no assignments: no error to record
    pred.observe(0, torch.tensor([[2, 0], [2, 0], [1, 1]]))  # per-rank counts
    assert pred.error(0) == pytest.approx(0.25)  # predicted [1, 1, 1] (from [2, 2, 2] and zeros): 3 / 6; mean of 0 and 0.5
    assert pred.error(1) is None
    other = LoadPredictor([3, 2], window=2)
    other.load_state_dict(pred.state_dict())
    assert other.error(0) == pred.error(0)
    state = pred.state_dict()
    del state["errors"]  # a checkpoint from before the errors were kept
    other.load_state_dict(state)
    assert other.error(0) is None and torch.equal(other.predict(0), pred.predict(0))
    fresh = LoadPredictor(3, window=1)
    assert math.isnan(fresh.observe(0, torch.tensor([1, 1, 1])))  # observe returns the error it records
    assert fresh.observe(0, torch.tensor([2, 1, 1])) == pytest.approx(1 / 4) == fresh.error(0)

"""Calibration that may evict (planner/calibrate.py): where the pre-gating placement filled every
slot, the replicas the actual loads do not need make room for the ones they do."""
import torch

from ds_fssdp import Topology
from ds_fssdp.planner import CostModel, ExpertShape, Hardware, calibrate, dispatch, materialize, shard_placement
from ds_fssdp.planner.calibrate import evict_to_budget
from ds_fssdp.planner.baselines import PolicyConfig, make_policy
from ds_fssdp.planner.shard import homogeneous_owner

HW = Hardware(flops=100e12, intra_bw=300e9, inter_bw=50e9, latency=10e-6)
SHAPE = ExpertShape(hidden=1024, ffn=4096)


def _full_wrong_guess():
    """8 experts on 4 ranks (2 each), budget 1: the guess filled every slot (expert 7 on ranks 0-2,
    expert 5 on rank 3), the actual loads are on expert 0."""
    topo = Topology(num_ranks=4, ranks_per_node=4)
    owner = homogeneous_owner(8, 4)
    shard = shard_placement(owner, 4)
    guess = shard.clone()
    guess[7] = True
    guess[5, 3] = True
    tokens = torch.tensor([[4000] * 4] + [[10] * 4] * 7)
    return topo, owner, shard, guess, tokens


def test_evict_to_budget_drops_the_least_loaded_overflow():
    shard = shard_placement(torch.tensor([0, 1, 0, 1]), 2)
    merged = shard.clone()
    merged[1, 0] = merged[3, 0] = True  # rank 0: two replicas, budget 1
    merged[0, 1] = True  # rank 1: one
    load = torch.tensor([5.0, 3.0, 1.0, 2.0])
    out = evict_to_budget(merged, merged & ~shard, shard, load, 1)
    assert out[1, 0] and not out[3, 0] and out[0, 1]  # expert 3 (load 2) goes, expert 1 (3) stays
    assert torch.equal(out & shard, shard)
    try:
        evict_to_budget(merged, torch.zeros_like(merged), shard, load, 1)
    except ValueError as e:
        assert "rank 0" in str(e) and "budget (1)" in str(e)
    else:
        raise AssertionError("an overflow without evictable replicas must be refused")


def test_a_full_wrong_placement_is_corrected_by_eviction():
    topo, owner, shard, guess, tokens = _full_wrong_guess()
    cost = CostModel(HW, SHAPE, topo)
    # The merge alone has no free slot: it adds nothing.
    assert torch.equal(materialize(owner, tokens.sum(1), topo, overlap_degree=4, budget=1, base_ED=guess), guess)
    cal = calibrate(owner, guess, tokens, topo, cost, overlap_degree=4, budget=1, latency_budget=float("inf"))
    final = cal.placement_ED
    assert cal.accepted and bool(final[0].all())  # the hot expert now on every rank
    assert cal.evicted_pairs == int((guess & ~final).sum()) >= 3
    assert cal.added_pairs == int((final & ~guess).sum()) >= 3
    assert torch.equal(final & shard, shard) and not bool((guess & ~final)[0].any())
    assert ((cal.placement_ED & ~shard).sum(0) <= 1).all()  # within the budget on every rank
    before = cost.layer_time(dispatch(guess, tokens, topo))
    after = cost.layer_time(dispatch(cal.placement_ED, tokens, topo))
    assert cal.saved_s == before - after and cal.saved_s > cal.extra_s > 0
    # Over the latency budget: neither candidate fits, nothing changes.
    cal = calibrate(owner, guess, tokens, topo, cost, overlap_degree=4, budget=1, latency_budget=1e-9)
    assert not cal.accepted and torch.equal(cal.placement_ED, guess) and cal.evicted_pairs == 0


def test_eviction_is_not_adopted_when_the_merge_is_as_good():
    topo, owner, shard, _, tokens = _full_wrong_guess()
    cost = CostModel(HW, SHAPE, topo)
    cal = calibrate(owner, shard, tokens, topo, cost, overlap_degree=4, budget=1, latency_budget=float("inf"))
    assert cal.accepted and cal.evicted_pairs == 0  # free slots: the merge is the evicting candidate


def test_the_policy_plan_keeps_evicted_replicas_apart():
    topo, owner, shard, guess, tokens = _full_wrong_guess()
    config = PolicyConfig(num_experts=8, num_layers=1, topology=topo, overlap_degree=4, budget=1,
                          cost=CostModel(HW, SHAPE, topo), calibration=True)
    lp = make_policy("fssdp", config).post_gating(0, owner, guess, tokens_ED=tokens)
    assert lp.evicted_ED is not None and torch.equal(lp.evicted_ED, guess & ~lp.placement_ED)
    assert int(lp.evicted_ED.sum()) == lp.calibration.evicted_pairs >= 3
    assert not bool((lp.evicted_ED & lp.placement_ED).any())
    assert torch.equal(lp.gathered_ED, guess & ~shard)  # the hidden gather moved what was guessed
    assert torch.equal(lp.hidden_ED | lp.calibrated_ED, lp.placement_ED & ~shard)  # what is reduced
    # no token goes to an evicted replica (plan_EDD: expert, source rank, computing rank)
    plan_EDD = make_policy("fssdp", config).dispatch(lp, tokens)
    assert int(plan_EDD.sum(1)[lp.evicted_ED].sum()) == 0 and int(plan_EDD.sum()) == int(tokens.sum())

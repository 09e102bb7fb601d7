"""Placement by time (planner/overlap.py ``choose_placement``): the t search runs over each family
of placements, and the least modelled layer time wins; the joint placement's ``stop`` knob that
its "every slot" family uses.

Where the answer is known: two hot experts, each routed to only by the node that does not own it,
with one slot a rank. Algorithm 1 shares the slots by load and spreads each expert's replicas over
both nodes (its first goes to the node lacking it, the rest to the ranks with the most free
slots), so half of them sit where none of its tokens come from; the joint placement puts them all
in the node that routes to it. So the joint family wins there, and the chosen placement never
prices worse than the configured family's alone."""
import pytest
import torch

from test_overlap_by_time import _policy as by_time_policy, _priced

from ds_fssdp.planner.baselines import Clock
from ds_fssdp.planner.joint import STOP, joint_materialize, joint_materialize_reference
from ds_fssdp.planner.overlap import choose_overlap_degree, choose_placement
from ds_fssdp.planner.shard import homogeneous_owner, shard_placement
from ds_fssdp.topology import Topology

E, D = 16, 8


def _family(prices: dict, calls: list, name: str):
    def place_at(t):
        calls.append((name, t))
        return torch.tensor([name == "b", t])
    return place_at


def _price_of(prices: dict):
    return lambda p: prices[("b" if bool(p[0]) else "a", int(p[1]))]


def test_the_least_priced_family_wins_and_every_candidate_is_counted():
    prices = {("a", 2): 9.0, ("a", 4): 8.0, ("a", 8): 8.5, ("b", 2): 9.5, ("b", 4): 7.0, ("b", 8): 6.0}
    calls = []
    families = {"a": _family(prices, calls, "a"), "b": _family(prices, calls, "b")}
    choice = choose_placement(families, _price_of(prices), window_t=2, max_t=8)
    assert (choice.family, choice.overlap_degree, choice.modelled_s) == ("b", 8, 6.0)
    assert calls == [("a", 2), ("a", 4), ("a", 8), ("b", 2), ("b", 4), ("b", 8)]
    assert choice.tried == 6 and choice.window_t == 2


def test_a_tie_keeps_the_earlier_family_and_one_family_is_the_t_search():
    prices = {("a", 2): 5.0, ("a", 4): 6.0, ("b", 2): 5.0, ("b", 4): 6.0}
    calls = []
    families = {"a": _family(prices, calls, "a"), "b": _family(prices, calls, "b")}
    choice = choose_placement(families, _price_of(prices), window_t=2, max_t=8)
    assert (choice.family, choice.overlap_degree) == ("a", 2)
    alone = choose_overlap_degree(_family(prices, [], "a"), _price_of(prices), window_t=2, max_t=8)
    only = choose_placement({"a": _family(prices, [], "a")}, _price_of(prices), window_t=2, max_t=8)
    assert (only.overlap_degree, only.modelled_s, only.tried, only.family) == (alone.overlap_degree,
                                                                               alone.modelled_s, alone.tried, "a")
    with pytest.raises(ValueError, match="no placement family"):
        choose_placement({}, _price_of(prices), window_t=2, max_t=8)


def _policy(inter_bw: float, *, rm: bool = False, placement: str = "paper", budget: int = 1):
    """Node links ``inter_bw``, rank links four times that (tests/test_overlap_by_time.py's)."""
    return by_time_policy(4 * inter_bw, rm=rm, budget=budget, placement=placement)


def _node_local_tokens() -> torch.Tensor:
    """Expert 11 (owned in node 1) is hot and only node 0's ranks route to it; expert 1 (owned in
    node 0) is hot and only node 1's ranks route to it."""
    tokens_ED = torch.full((E, D), 64.0)
    tokens_ED[11, :4], tokens_ED[11, 4:] = 6000.0, 0.0
    tokens_ED[1, 4:], tokens_ED[1, :4] = 6000.0, 0.0
    return tokens_ED


@pytest.mark.parametrize("rm", [False, True])
def test_the_joint_family_wins_where_the_tokens_come_from_one_node(rm):
    owner_E = homogeneous_owner(E, D)
    assert (int(owner_E[11]) // 4, int(owner_E[1]) // 4) == (1, 0)
    tokens_ED = _node_local_tokens()
    policy, cost = _policy(1e9, rm=rm)
    window = cost.overlap_window(1)
    clock = Clock(overlap_degree=cost.overlap_degree(window), window_s=window)
    choice = policy.overlap_choice(owner_E, tokens_ED, clock)
    paper = choose_overlap_degree(lambda t: policy._place(owner_E, tokens_ED, t),
                                  lambda p: _priced(policy, cost, owner_E, p, tokens_ED, window),
                                  window_t=clock.overlap_degree, max_t=E)
    assert choice.family == "joint-fill"
    assert choice.modelled_s < paper.modelled_s
    assert choice.modelled_s == pytest.approx(_priced(policy, cost, owner_E, choice.placement_ED, tokens_ED, window))
    added_ED = choice.placement_ED & ~shard_placement(owner_E, D)
    assert int(added_ED[11, :4].sum()) > 0 and int(added_ED[1, 4:].sum()) > 0  # where their tokens come from
    assert int(added_ED[11, 4:].sum()) == 0 and int(added_ED[1, :4].sum()) == 0
    assert choice.modelled_s < 0.5 * paper.modelled_s
    placed, t = policy.pre_gating_t(0, owner_E, tokens_ED, clock=clock)  # what the runtime and simulators call
    assert torch.equal(placed, choice.placement_ED) and t == choice.overlap_degree


def test_per_expert_loads_search_the_configured_family_alone():
    owner_E = homogeneous_owner(E, D)
    policy, cost = _policy(1e9)
    window = cost.overlap_window(1)
    clock = Clock(overlap_degree=cost.overlap_degree(window), window_s=window)
    choice = policy.overlap_choice(owner_E, _node_local_tokens().sum(1), clock)
    assert choice.family == "paper"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("placement", ["paper", "joint"])
def test_never_prices_worse_than_the_configured_family_alone(seed, placement):
    g = torch.Generator().manual_seed(seed)
    owner_E = torch.randint(0, D, (E, ), generator=g)
    owner_E[:D] = torch.arange(D)
    share_E = torch.rand(E, generator=g) ** 4
    tokens_ED = (share_E[:, None] / share_E.sum() * 4096 * torch.rand(E, D, generator=g) ** 2).round()
    policy, cost = _policy(10 ** float(torch.empty(1).uniform_(8, 11, generator=g)), placement=placement,
                           budget=int(seed) + 1)
    window = cost.overlap_window(int(torch.randint(0, 4, (1, ), generator=g)))
    clock = Clock(overlap_degree=cost.overlap_degree(window), window_s=window)
    choice = policy.overlap_choice(owner_E, tokens_ED, clock)
    alone = choose_overlap_degree(lambda t: policy._place(owner_E, tokens_ED, t),
                                  lambda p: _priced(policy, cost, owner_E, p, tokens_ED, window),
                                  window_t=clock.overlap_degree, max_t=E)
    assert choice.modelled_s <= alone.modelled_s
    assert choice.family in (placement, "joint-fill")
    if choice.family == placement:
        assert torch.equal(choice.placement_ED, alone.placement_ED)


def _tokens(seed: int, E: int, D: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    share = torch.softmax(torch.randn(E, generator=g) * 1.5, 0)
    return torch.distributions.Multinomial(total_count=40 * D, probs=share).sample((D, )).t().double()


@pytest.mark.parametrize("stop", [0.0, 0.1, STOP, 1.0])
def test_joint_stop_knob_c_equals_reference_and_zero_fills_every_useful_slot(stop):
    topo = Topology(num_ranks=8, ranks_per_node=4)
    owner = homogeneous_owner(16, 8)
    for seed in range(4):
        T = _tokens(seed, 16, 8)
        T[3] = 0.0  # an expert nobody routes to
        for t, m in ((4, 1), (16, 3), (16, 8)):
            got = joint_materialize(owner, T, topo, overlap_degree=t, budget=m, stop=stop)
            assert torch.equal(got, joint_materialize_reference(owner, T, topo, overlap_degree=t, budget=m,
                                                                stop=stop))
            assert int(got[3].sum()) == 1  # no demand, no replica, even at stop 0
            if stop == 0.0:
                default = joint_materialize(owner, T, topo, overlap_degree=t, budget=m)
                assert int(got.sum()) >= int(default.sum())


def test_joint_stop_zero_places_more_than_the_default_on_a_spread_load():
    topo = Topology(num_ranks=8, ranks_per_node=4)
    owner = homogeneous_owner(16, 8)
    T = torch.full((16, 8), 10.0)
    T[0] = 10000.0  # past covering the nodes, only expert 0's per-holder load reaches STOP of a rank's mean
    assert int(joint_materialize(owner, T, topo, overlap_degree=16, budget=4).sum()) == 38
    assert int(joint_materialize(owner, T, topo, overlap_degree=16, budget=4, stop=0.0).sum()) == 16 + 8 * 4


@pytest.mark.parametrize("bad", [-0.1, float("nan")])
def test_a_bad_stop_is_a_value_error(bad):
    topo = Topology(num_ranks=4, ranks_per_node=2)
    owner = homogeneous_owner(8, 4)
    for fn in (joint_materialize, joint_materialize_reference):
        with pytest.raises(ValueError, match=r"stop \((-0.1|nan)\) must be >= 0"):
            fn(owner, torch.ones(8, 4, dtype=torch.float64), topo, overlap_degree=2, budget=1, stop=bad)

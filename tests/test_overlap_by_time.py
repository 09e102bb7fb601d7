"""t by time (planner/overlap.py): the doubling search, and FSSDP's pre-gating taking it.

The search's own contract on synthetic placements and prices; then the policy on a cost model
where the answer is known: with fast links a skewed layer takes more experts than its window
hides (their gather costs less than the balance they buy), with slow links it keeps the window's
t, and the chosen placement never prices worse than the window's."""
import math

import pytest
import torch

from ds_fssdp.planner.baselines import Clock, PolicyConfig, make_policy
from ds_fssdp.planner.cost import CostModel, ExpertShape, Hardware, exposed_transfer
from ds_fssdp.planner.overlap import choose_overlap_degree, layer_seconds
from ds_fssdp.planner.shard import homogeneous_owner
from ds_fssdp.topology import Topology


def _search(prices: dict, *, window_t: int, max_t: int, placements=None):
    """choose_overlap_degree over placements keyed by t (a placement per distinct t unless given)."""
    calls = []

    def place_at(t):
        calls.append(t)
        return placements[t] if placements is not None else torch.tensor([t])

    return choose_overlap_degree(place_at, lambda p: prices[int(p[0])], window_t=window_t, max_t=max_t), calls


def test_search_doubles_while_faster_and_stops_at_the_first_slower():
    prices = {4: 10.0, 8: 8.0, 16: 7.0, 32: 7.5, 64: 1.0}
    choice, calls = _search(prices, window_t=4, max_t=64)
    assert (choice.overlap_degree, choice.modelled_s, choice.window_t) == (16, 7.0, 4)
    assert calls == [4, 8, 16, 32]  # 64 (cheaper) is never priced: the search stops at 32
    assert choice.tried == 4


def test_search_keeps_the_smaller_t_on_a_tie_and_caps_at_max_t():
    choice, _ = _search({4: 5.0, 8: 5.0}, window_t=4, max_t=64)
    assert choice.overlap_degree == 4
    choice, calls = _search({3: 9.0, 6: 8.0, 10: 1.0}, window_t=3, max_t=10)
    assert (choice.overlap_degree, calls) == (10, [3, 6, 10])
    choice, calls = _search({10: 2.0}, window_t=12, max_t=10)  # the window's t beyond E: E
    assert (choice.overlap_degree, calls) == (10, [10])


def test_search_from_zero_tries_one_and_stops_when_nothing_is_added():
    choice, calls = _search({0: 3.0, 1: 2.0, 2: 1.0, 4: 1.5}, window_t=0, max_t=8)
    assert choice.overlap_degree == 2 and calls == [0, 1, 2, 4]
    same = {t: torch.tensor([0]) for t in (0, 1, 2, 4, 8)}  # the budget is full: nothing more to add
    choice, calls = _search({0: 3.0}, window_t=0, max_t=8, placements=same)
    assert (choice.overlap_degree, choice.tried, calls) == (0, 1, [0, 1])
    with pytest.raises(ValueError, match="window_t"):
        choose_overlap_degree(lambda t: None, lambda p: 0.0, window_t=-1, max_t=4)


def test_exposed_transfer_counts_the_rematerialized_gather_in_the_backward():
    assert exposed_transfer(3.0, 1.0) == 2.0 + 1.0
    assert exposed_transfer(3.0, 1.0, rematerialize=True) == 2.0 + 4.0
    assert exposed_transfer(1.0, 1.0, rematerialize=True) == 0.0


def test_exposed_transfer_takes_the_backward_window_given():
    assert exposed_transfer(3.0, 1.0, backward_window_s=2.5) == 2.0 + 0.5
    assert exposed_transfer(3.0, 1.0, rematerialize=True, backward_window_s=7.0) == 2.0


E, D = 16, 8
TOPO = Topology(num_ranks=D, ranks_per_node=4)
SHAPE = ExpertShape(hidden=256, ffn=512, matrices=2, param_bytes=2)


def _policy(bw: float, *, by_time: bool = True, rm: bool = False, budget: int = 6, shape: ExpertShape = SHAPE,
            placement: str = "paper"):
    cost = CostModel(Hardware(flops=1e12, intra_bw=bw, inter_bw=bw / 4), shape, TOPO, relay=True)
    config = PolicyConfig(num_experts=E, num_layers=1, topology=TOPO, budget=budget, overlap_degree=1, cost=cost,
                          overlap_by_time=by_time, placement=placement)
    return make_policy("fssdp-rm" if rm else "fssdp", config), cost


def _skewed_tokens(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    share_E = torch.rand(E, generator=g) ** 4  # a few hot experts
    share_E /= share_E.sum()
    return (share_E[:, None] * 4096 * (0.5 + torch.rand(E, D, generator=g))).round()


def _priced(policy, cost, owner_E, placement_ED, tokens_ED, window):
    return layer_seconds(cost, owner_E, placement_ED, tokens_ED.long(), plan_of=policy.compact_plan,
                         window_s=window, rematerialize=policy.rematerialize)


@pytest.mark.parametrize("rm", [False, True])
def test_fast_links_take_more_experts_than_the_window_hides_slow_links_keep_it(rm):
    owner_E = homogeneous_owner(E, D)
    tokens_ED = _skewed_tokens(0)
    fast, cost = _policy(1e12, rm=rm)
    window = cost.overlap_window(1)  # one expert's gather fits: the window's t is 1
    clock = Clock(overlap_degree=cost.overlap_degree(window), window_s=window)
    assert clock.overlap_degree == 1
    placed_ED, t = fast.pre_gating_t(0, owner_E, tokens_ED, clock=clock)
    window_ED = fast._place(owner_E, tokens_ED, 1)
    assert t > 1 and placed_ED.sum() > window_ED.sum()
    assert _priced(fast, cost, owner_E, placed_ED, tokens_ED, window) < _priced(fast, cost, owner_E, window_ED,
                                                                                tokens_ED, window)
    # A big expert (Mixtral's) on slow links for few tokens: exposing its gather costs more than the
    # balance it buys.
    slow, cost = _policy(1e9, rm=rm, shape=ExpertShape(hidden=4096, ffn=14336, matrices=3, param_bytes=2))
    window, few_ED = cost.overlap_window(1), (tokens_ED / 16).round()
    placed_ED, t = slow.pre_gating_t(0, owner_E, few_ED, clock=Clock(overlap_degree=1, window_s=window))
    assert t == 1 and torch.equal(placed_ED, slow._place(owner_E, few_ED, 1))


def test_the_search_needs_its_switch_a_cost_and_a_window():
    owner_E, tokens_ED = homogeneous_owner(E, D), _skewed_tokens(1)
    policy, cost = _policy(1e12, by_time=False)
    window = cost.overlap_window(1)
    placed_ED, t = policy.pre_gating_t(0, owner_E, tokens_ED, clock=Clock(overlap_degree=1, window_s=window))
    assert t == 1 and torch.equal(placed_ED, policy._place(owner_E, tokens_ED, 1))
    policy, _ = _policy(1e12)
    assert policy.pre_gating_t(0, owner_E, tokens_ED, clock=Clock(overlap_degree=1))[1] == 1  # no window
    shard_ED, t = policy.pre_gating_t(0, owner_E, None, clock=Clock(overlap_degree=1, window_s=window))
    assert t == 1 and not shard_ED.sum(1).gt(1).any()  # no prediction yet: the shard alone


@pytest.mark.parametrize("seed", range(6))
def test_never_prices_worse_than_the_window_and_loads_alone_work(seed):
    """Over random skews, link speeds and windows, the searched placement's modelled time is at
    most the window's; per-expert loads (no per-rank prediction yet) are spread over the ranks."""
    g = torch.Generator().manual_seed(seed)
    owner_E = torch.randint(0, D, (E, ), generator=g)
    owner_E[:D] = torch.arange(D)
    tokens_ED = _skewed_tokens(seed)
    policy, cost = _policy(10 ** float(torch.empty(1).uniform_(8, 12, generator=g)), budget=int(seed) + 1)
    window = cost.overlap_window(int(torch.randint(0, 4, (1, ), generator=g)))
    t_window = cost.overlap_degree(window)
    for predicted in (tokens_ED, tokens_ED.sum(1)):
        clock = Clock(overlap_degree=t_window, window_s=window)
        choice = policy.overlap_choice(owner_E, predicted, clock)
        spread_ED = tokens_ED if predicted.dim() == 2 else (predicted[:, None].expand(-1, D) / D).round()
        base = _priced(policy, cost, owner_E, policy._place(owner_E, predicted, t_window), spread_ED, window)
        assert choice.modelled_s <= base and choice.overlap_degree >= t_window
        priced = _priced(policy, cost, owner_E, choice.placement_ED, spread_ED, window)
        assert math.isclose(choice.modelled_s, priced)


def test_the_reduce_is_priced_against_the_schedules_backward_window():
    """With the layer priced as its exchange runs (ScheduledCostModel) and the clock's attention,
    the reduce's window is the attention backward plus the time the layer's backward exchange
    leaves the node link free (scheduled.reduce_window_s, what the simulators charge), not twice
    the forward window; without the attention (an older clock), twice the window."""
    from ds_fssdp.planner.scheduled import ExchangeOptions, ScheduledCostModel, reduce_window_s
    owner_E, tokens_ED = homogeneous_owner(E, D), _skewed_tokens(2)
    hw = Hardware(flops=1e12, intra_bw=1e10, inter_bw=2.5e9)
    cost = ScheduledCostModel(hw, SHAPE, TOPO, relay=True, exchange=ExchangeOptions(
        top_k=2, token_bytes=float(SHAPE.token_bytes), weight_bytes=float(SHAPE.param_bytes)))
    policy = make_policy("fssdp", PolicyConfig(num_experts=E, num_layers=1, topology=TOPO, budget=6,
                                               overlap_degree=1, cost=cost, overlap_by_time=True))
    placement_ED = policy._place(owner_E, tokens_ED, 8)
    plan = policy.compact_plan(placement_ED, tokens_ED.long())
    gather, attention, window = cost.gather_time(owner_E, placement_ED), 1e-4, 3e-4
    layer_s = cost.layer_time(plan)
    window_b = reduce_window_s(cost.costs, cost.price(plan), attention, across_nodes=True)
    assert window_b > 2.0 * attention  # the backward leaves the node link idle for a while
    assert window_b != 2.0 * window
    priced = layer_seconds(cost, owner_E, placement_ED, tokens_ED.long(), plan_of=policy.compact_plan,
                           window_s=window, rematerialize=False, attention_s=attention)
    assert priced == pytest.approx(layer_s + exposed_transfer(gather, window, backward_window_s=window_b), rel=1e-12)
    older = layer_seconds(cost, owner_E, placement_ED, tokens_ED.long(), plan_of=policy.compact_plan,
                          window_s=window, rematerialize=False)
    assert older == pytest.approx(layer_s + exposed_transfer(gather, window), rel=1e-12)
    assert older != pytest.approx(priced)

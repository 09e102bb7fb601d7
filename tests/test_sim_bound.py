"""The simulators' lower bound (ds_fssdp/sim/bound.py): its shortest path over the layers equals
brute force over every choice sequence; its least bytes to leave a source are never more than the
simulators' one copy per destination sends for any split that respects a destination's share;
replicas and FlexMoE's slots lower it and holding more never raises it; the slots still pay their
gradients over the node link, after the backward, replicas past FSSDP's m their reduce twice; the
choices span every split of a node's experts into gathered and kept; and it stays below
every policy of both engines where the replicas' gathers and the node links bind."""
import dataclasses
import itertools

import numpy as np
import pytest

from ds_fssdp import Topology
from ds_fssdp.planner import ExpertShape, Hardware
from ds_fssdp.sim import bound as bound_module
from ds_fssdp.sim.bound import Choices, LowerBound, chain_bound, chain_values, leaving_bytes, top_rows
from ds_fssdp.sim.cluster import simulate_cluster
from ds_fssdp.sim.links import distinct_fraction
from ds_fssdp.sim.setup import Setup, derive_overlap_degree
from ds_fssdp.sim.cluster import simulate
from ds_fssdp.sim.synth import synthetic_trace

SHAPE = ExpertShape(hidden=512, ffn=2048)


def setup_with(hw, *, budget=3, budget_rm=6, flexmoe_slots=2, layers=3, ranks_per_node=4, side_ratio=0.0) -> Setup:
    topo = Topology(num_ranks=8, ranks_per_node=ranks_per_node)
    tokens, d, s = 16384, 512, 1024
    flops = 8.0 * d * d + 2.0 * s * d
    return Setup(topology=topo, hw=hw, shape=SHAPE, num_layers=layers, num_experts=16, tokens_per_gpu=tokens,
                 attention_flops_per_token=flops, dense_params=2 * 4 * d * d,
                 overlap_degree=derive_overlap_degree(hw, topo, SHAPE, attention_s=tokens * flops / hw.flops),
                 budget=budget, budget_rm=budget_rm, flexmoe_slots=flexmoe_slots, reshard_interval=8,
                 smartmoe_interval=4, top_k=2, side_ratio=side_ratio)


def skewed(setup, steps=10, seed=3, std=0.12):
    return synthetic_trace(steps=steps, num_layers=setup.num_layers, num_experts=16, num_ranks=8,
                           assignments_per_rank=2 * setup.tokens_per_gpu, target_std=std, top_k=2,
                           seed=seed).tokens_SLED


def test_chain_bound_is_the_least_over_every_choice_sequence():
    rng = np.random.default_rng(0)
    for trial in range(40):
        L, K = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        m, g_K = rng.uniform(0, 1, (L, K)), rng.uniform(0, 2, K)
        u = m * rng.uniform(0, 1, (L, K)) * (trial % 2)  # the link the next gather uses, busy <= m
        attn, v, ar = float(rng.uniform(0, 0.5)), float(rng.choice([0.0, 0.3, 1.0])), float(rng.uniform(0, 3))
        w = float(rng.choice([1.0, 0.4, 0.0]))  # the forward's weight (ZeRO 1's u)
        if trial < 20:  # each choice its own state
            state, b, g, x = np.arange(K), rng.uniform(0, 1, (L, K)), g_K, np.zeros(K)
            kw = {}
        else:  # choices that share a state's exchange: their own gather, backward and what they add after it
            state = np.sort(np.concatenate([np.arange(K), rng.integers(0, K, int(rng.integers(0, 4)))]))
            b, g, x = rng.uniform(0, 1, (L, state.size)), rng.uniform(0, 2, state.size), rng.uniform(0, 0.5, state.size)
            kw = {"state_C": state, "exposed_C": x}
        best = np.inf
        for cs in itertools.product(range(state.size), repeat=L):
            ks = [state[c] for c in cs]
            fwd = sum(max(attn + (m[l - 1, ks[l - 1]] if l else 0.0), g[cs[l]] + (u[l - 1, ks[l - 1]] if l else 0.0))
                      for l in range(L)) + m[L - 1, ks[-1]]
            best = min(best, w * fwd + sum(v * b[l, cs[l]] + x[cs[l]] for l in range(L)) + (1 - v) * ar)
        assert chain_bound(m, b, g, attn, v, ar, u, u=w, **kw) == pytest.approx(best, rel=1e-12), trial


def test_chain_bound_of_many_v_is_each_v_alone_exactly():
    # the bound evaluates its v grid in one call: every value bit for bit what one call per v gives
    rng = np.random.default_rng(1)
    vs = np.linspace(0.0, 1.0, 11)
    for trial in range(10):
        L, K = int(rng.integers(1, 6)), int(rng.integers(1, 30))
        state = np.sort(np.concatenate([np.arange(K), rng.integers(0, K, int(rng.integers(0, 40)))]))
        m, b = rng.uniform(0, 1, (L, K)), rng.uniform(0, 1, (L, state.size))
        busy, g, x = m * rng.uniform(0, 1, (L, K)), rng.uniform(0, 2, state.size), rng.uniform(0, 0.5, state.size)
        w, attn, ar = float(rng.choice([1.0, 0.3])), float(rng.uniform(0, 0.5)), float(rng.uniform(0, 3))
        many = chain_bound(m, b, g, attn, vs, ar, busy, state_C=state, exposed_C=x, u=w)
        one = [chain_bound(m, b, g, attn, v, ar, busy, state_C=state, exposed_C=x, u=w) for v in vs]
        assert many.tolist() == one, trial
        assert len(set(one)) > 1, trial  # v matters here: a negative control for a grid collapsed to one v


@pytest.mark.skipif(bound_module._fastbound is None, reason="ds_fssdp.sim._fastbound is not built")
def test_chain_in_c_is_the_numpy_path_exactly(monkeypatch):
    # _fastbound.chain: every u, group and v of the numpy path bit for bit (==, not approx), also
    # with ties among the states' a (the stable order) and gathers equal to an a (searchsorted's side)
    rng = np.random.default_rng(2)
    vs = np.linspace(0.0, 1.0, 11)
    for trial in range(30):
        L, K, B = int(rng.integers(1, 8)), int(rng.integers(1, 25)), int(rng.integers(1, 4))
        state = np.sort(np.concatenate([np.arange(K), rng.integers(0, K, int(rng.integers(0, 50)))]))
        m = rng.uniform(0, 1, (L, K, B))
        if trial % 3 == 0:  # ties: few distinct values
            m = np.round(m * 4) / 4
        busy = m * rng.uniform(0, 1, (L, K, B)) * (trial % 2)
        b, x = rng.uniform(0, 1, (L, state.size, B)), rng.uniform(0, 0.5, state.size) * (trial % 4 != 1)
        g = rng.uniform(0, 2, state.size)
        attn = float(rng.uniform(0, 0.5))
        if trial % 3 == 0:
            g[: state.size // 2] = attn + m[0, rng.integers(0, K, state.size // 2), 0]  # a gather at an a
        us = np.array([1.0, 0.0, 0.3, float(rng.uniform(0, 1))])
        kw = {"state_C": state, "exposed_C": x if trial % 5 else None}
        fast = chain_values(m, b, g, attn, vs, busy, us, **kw)
        ones = [chain_bound(m[:, :, 0], b[:, :, 0], g, attn, v, 0.7, busy[:, :, 0], u=0.3, **kw) for v in vs]
        with monkeypatch.context() as patch:
            patch.setattr(bound_module, "_fastbound", None)
            slow = chain_values(m, b, g, attn, vs, busy, us, **kw)
            assert [chain_bound(m[:, :, 0], b[:, :, 0], g, attn, v, 0.7, busy[:, :, 0], u=0.3, **kw) for v in vs] == ones
        assert fast.shape == (us.size, B, vs.size) and fast.tolist() == slow.tolist(), trial
        assert len(np.unique(fast)) > us.size, trial  # u, b and v matter: not one number everywhere


def test_slot_choices_span_what_a_node_can_hold():
    # 2 nodes of 4 ranks, 16 experts, one owned a rank: a node's S distinct experts beyond its 4 owned
    # are gathered (at most 4 R) or kept in slots (at most 4 x 2), and every split is a choice
    ch = Choices(E=16, G=4, n=2, own=1, budget=1, persistent=2)
    seen = {(int(ch.R_A[ch.a_K[k]]), int(ch.S[ch.s_K[k]]), int(p)) for k, p in zip(ch.state_C, ch.P_C)}
    want = {(R, S, P) for R in (0, 1) for S in range(4, 16 + 1) for P in range(0, 9)
            if 0 <= S - 4 - P <= 4 * R and S <= 4 * (1 + 2 + R)}
    assert seen == want
    assert (np.diff(ch.state_C) >= 0).all() and set(ch.state_C) == set(range(ch.a_K.size))
    # one node: a rank's slots in use are the choice, and nothing crosses a node link
    one = Choices(E=16, G=8, n=1, own=2, budget=2, persistent=3)
    assert sorted(zip(one.R_A.tolist(), one.p_A.tolist())) == [(R, p) for R in range(3) for p in range(4)]
    assert (one.P_C == 0).all() and one.S.tolist() == [0]


def test_leaving_bytes_never_exceeds_what_one_copy_per_destination_sends():
    rng = np.random.default_rng(1)
    k, tb = 4, 10.0
    for trial in range(300):
        rows = float(rng.integers(1, 1000))
        kept = float(rng.uniform(0, rows))
        share = float(rng.uniform(0.01, 1.0))
        # a split of what leaves over destinations, each at most ``share`` of the rows
        left, split = rows - kept, []
        while left > 1e-9:
            r = min(left, float(rng.uniform(0, share * rows)) or left)
            split.append(r)
            left -= r
        r_h = np.array(split)
        p_h = r_h / rows
        sent = float((r_h * distinct_fraction(np.array([[np.append(r_h, kept)]]), k)[0, 0, :-1]).sum()) * tb
        assert sent == pytest.approx(float((r_h * (1 - (1 - p_h) ** k) / (k * p_h)).sum()) * tb)
        low = float(leaving_bytes(np.array(rows), np.array(kept), k, tb, share=np.array(share)))
        assert (rows - kept) / k * tb * (1 - 1e-12) <= low <= sent * (1 + 1e-12), trial
        assert float(leaving_bytes(np.array(rows), np.array(kept), k, tb)) == pytest.approx((rows - kept) / k * tb)
    # the extreme: every destination at its share, and one remainder
    rows, share = 100.0, 0.25
    r_h = np.array([25.0, 25.0, 10.0])
    want = float((r_h * (1 - (1 - r_h / rows) ** k) / (k * r_h / rows)).sum()) * tb
    assert float(leaving_bytes(np.array(rows), np.array(40.0), k, tb, share=np.array(share))) == pytest.approx(want)


@pytest.mark.parametrize("in_c", [True, False])
def test_top_rows_are_the_running_sums_of_each_column_largest_first(monkeypatch, in_c):
    if not in_c:  # the numpy path
        monkeypatch.setattr(bound_module, "_fastbound", None)
    rng = np.random.default_rng(4)
    for shape in [(7, ), (16, 3, 5), (9, 1, 1), (0, 4), (1, 2), (16, 3, 5)]:
        t = rng.integers(0, 50, shape).astype(np.float64) * rng.uniform(0.5, 2.0)
        before = t.copy()
        want = np.zeros((shape[0] + 1, ) + shape[1:])
        desc = -np.sort(-t, axis=0)
        for i in range(shape[0]):  # one addition per row, in order
            want[i + 1] = want[i] + desc[i]
        got = top_rows(t)
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), shape
        into = np.full(want.shape, np.nan)
        assert top_rows(t, out=into) is into and into.tobytes() == want.tobytes(), shape
        assert (t == before).all()  # the input is left alone


def bound(setup, tokens, **kw):
    low = LowerBound(setup, group_size=8, **kw)
    for s, t in enumerate(tokens):
        low.step(s, t)
    return low.result()


@pytest.mark.skipif(bound_module._fastbound is None, reason="ds_fssdp.sim._fastbound is not built")
@pytest.mark.parametrize("ranks_per_node", [2, 8])
def test_bound_with_its_chain_in_c_is_the_numpy_bound_exactly(monkeypatch, ranks_per_node):
    # several groups, ZeRO 0 (both syncs) and ZeRO 1 (the (u, v) grid), replicas and slots
    hw = Hardware(flops=100e12, intra_bw=50e9, inter_bw=5e9, latency=10e-6, hbm_bw=2e12)
    setup = setup_with(hw, ranks_per_node=ranks_per_node)
    tokens = skewed(setup, steps=8)
    for zero in (0, 1):
        st = dataclasses.replace(setup, zero_stage=zero)
        kw = {"group_size": 4, "budget": 2, "persistent": 1, "plain": 1}

        def run():
            low = LowerBound(st, **kw)
            for s, t in enumerate(tokens):
                low.step(s, t)
            return low.result()

        fast = run()
        with monkeypatch.context() as patch:
            patch.setattr(bound_module, "_fastbound", None)
            assert run() == fast, zero


def test_replicas_and_slots_lower_the_bound_and_holding_more_never_raises_it():
    # a slow node link: what crosses nodes, and the replicas that avoid it, both cost
    hw = Hardware(flops=100e12, intra_bw=50e9, inter_bw=5e9, latency=10e-6, hbm_bw=2e12)
    setup = setup_with(hw)
    tokens = skewed(setup)
    none, priced, slots = bound(setup, tokens, budget=0), bound(setup, tokens, budget=6), bound(setup, tokens, budget=0,
                                                                                                persistent=6)
    assert priced < none and slots < none
    assert bound(setup, tokens, budget=12) <= priced * (1 + 1e-12)
    assert bound(setup, tokens, budget=6, persistent=6) <= min(priced, slots) * (1 + 1e-12)


def test_slots_sync_after_the_backward():
    """Two nodes of one rank, two experts, every rank's tokens split evenly over them: with a slot
    each rank keeps all its rows, and the slot's expert is all-reduced over the node link after the
    backward (FlexMoE's ring in the simulator), never hidden in the long backward. The bound
    with slots then grows by exactly one expert over the node link per layer as the link slows."""
    topo = Topology(num_ranks=2, ranks_per_node=1)
    fast = Hardware(flops=100e12, intra_bw=100e9, inter_bw=2e9, latency=10e-6, hbm_bw=2e12)
    slow = dataclasses.replace(fast, inter_bw=1e9)
    layers, tokens = 2, 16384
    setup = Setup(topology=topo, hw=fast, shape=SHAPE, num_layers=layers, num_experts=2, tokens_per_gpu=tokens,
                  attention_flops_per_token=6e7, dense_params=0, overlap_degree=2, budget=0, budget_rm=0,
                  flexmoe_slots=1, reshard_interval=8, smartmoe_interval=4, top_k=1, load_window=1)
    trace = np.full((3, layers, 2, 2), tokens // 2)
    with_slot = {hw: LowerBound(dataclasses.replace(setup, hw=hw), group_size=2, budget=0, persistent=1)
                 for hw in (fast, slow)}
    for s, t in enumerate(trace):
        for low in with_slot.values():
            low.step(s, t)
    psi = float(SHAPE.expert_bytes)
    grown = with_slot[slow].result() - with_slot[fast].result()
    assert grown == pytest.approx(layers * (psi / slow.inter_bw - psi / fast.inter_bw), rel=1e-9)
    # the attention backward alone would hide the sync, were it charged there; the rows a rank would
    # send without its slot take longer on the link than the sync
    assert 2 * setup.attention_fwd_s > 3 * psi / slow.inter_bw
    assert tokens // 2 * SHAPE.token_bytes > psi


def test_persistent_slots_still_pay_their_gradients_over_the_node_link():
    # Slots for every expert let a node keep all of its tokens' rows: nothing is gathered, yet every
    # expert a node holds beyond its owned ones syncs its gradient over the node link in the backward.
    fast = Hardware(flops=100e12, intra_bw=50e9, inter_bw=50e9, latency=10e-6, hbm_bw=2e12)
    slow = dataclasses.replace(fast, inter_bw=1e9)
    setup = setup_with(fast)
    tokens = skewed(setup)
    everywhere = {"budget": 0, "persistent": setup.num_experts}
    assert bound(dataclasses.replace(setup, hw=slow), tokens, **everywhere) > bound(setup, tokens, **everywhere) * 1.05
    # one node: no node link to cross, the bound does not see it
    one = setup_with(fast, ranks_per_node=8)
    assert bound(dataclasses.replace(one, hw=slow), tokens, **everywhere) == pytest.approx(
        bound(one, tokens, **everywhere), rel=1e-12)


def test_replicas_past_the_plain_budget_pay_their_reduce_twice():
    # past m only fssdp-rm (gathered again for the backward) or FasterMoE's shadows hold replicas
    hw = Hardware(flops=100e12, intra_bw=50e9, inter_bw=1e9, latency=10e-6, hbm_bw=2e12)
    setup = setup_with(hw)
    tokens = skewed(setup)
    once, twice, none = (bound(setup, tokens, budget=2), bound(setup, tokens, budget=2, plain=0),
                         bound(setup, tokens, budget=0))
    assert once < twice <= none * (1 + 1e-12)
    assert bound(setup, tokens, budget=2, plain=2) == once


@pytest.mark.parametrize("hw,ranks_per_node,side_ratio", [
    (Hardware(flops=100e12, intra_bw=200e9, inter_bw=25e9, latency=10e-6, hbm_bw=2e12), 4, 0.0),
    (Hardware(flops=100e12, intra_bw=50e9, inter_bw=5e9, latency=10e-6, hbm_bw=2e12), 4, 0.0),
    (Hardware(flops=100e12, intra_bw=20e9, inter_bw=5e9, latency=10e-6, hbm_bw=2e12), 8, 0.0),
    (Hardware(flops=100e12, intra_bw=50e9, inter_bw=5e9, latency=10e-6, hbm_bw=2e12), 4, 2.0)],
    ids=["fast-links", "slow-links", "one-node", "slow-links-shared-experts"])
def test_bound_is_below_every_policy_of_both_engines(hw, ranks_per_node, side_ratio):
    """FSSDP's t searched by time exposes gathers on the link the previous layer's exchange holds:
    the case the bound's busy term (``chain_bound``'s u) must still be below. With shared experts
    (two expert rows a token) the schedules hide them behind the exchange, and the bound, which
    lets them, stays below."""
    setup = setup_with(hw, budget=6, budget_rm=10, ranks_per_node=ranks_per_node, side_ratio=side_ratio)
    tokens = skewed(setup)
    for results in (simulate(setup, tokens, ["ep", "uniform", "fastermoe", "smartmoe", "flexmoe", "fssdp",
                                             "fssdp-rm", "fsmoe"]),
                    simulate_cluster(setup, tokens, ["ep", "uniform", "fsmoe", "fssdp", "fssdp-rm"], group_size=8),
                    # every expert gathered every step: the most exposed gathers either engine runs
                    simulate(dataclasses.replace(setup, overlap_degree=16), tokens, ["fssdp", "fssdp-rm"],
                             fixed_t=True),
                    simulate_cluster(setup, tokens, ["fssdp", "fssdp-rm"], group_size=8, overlap_degree=16)):
        for r in results:
            assert 0 < r.lower_bound_s <= r.iteration_s, (r.policy, r.lower_bound_s, r.iteration_s)

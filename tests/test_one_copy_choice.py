"""One copy per destination where it pays (planner/onecopy.choose_one_copy; across nodes as the
runtime's two hops): its overhead is what the runtime adds (the count all-gather, the routing
entries, the gate weights), it is taken only when the modelled layer is faster with it, and the
simulator's layer pricing takes the same decision by the same call."""
import numpy as np
import pytest

from ds_fssdp.planner.cost import ExpertShape, Hardware, schedule_costs
from ds_fssdp.planner.onecopy import INDEX_BYTES, choose_one_copy, distinct_fraction, one_copy_overhead_s
from ds_fssdp.planner.schedule import Linear, ScheduleCosts
from ds_fssdp.sim.pipeline import LayerSchedule, ScheduleOptions


def costs(startup, per_byte, concurrent=False):
    link = Linear(startup_s=startup, per_unit_s=per_byte)
    return ScheduleCosts(a2a_intra=link, a2a_inter=link, gemm=Linear(startup_s=1e-5, per_unit_s=1e-7),
                         backward_factor=2.0, concurrent=concurrent)


CROWDED = np.array([[100.0, 900.0], [800.0, 200.0]])  # most rows of a rank go to the other: many tokens share it


def test_overhead_is_the_count_gather_the_entries_and_the_weights():
    c = costs(1e-4, 1e-9)
    sent = np.array([[5.0, 10.0], [20.0, 0.0]])
    f, b = one_copy_overhead_s(c, sent, ranks_per_node=2, top_k=4, weight_bytes=4, degrees=(1, 1))
    entries = 1e-4 + np.array([10.0, 20.0]) * 4 * INDEX_BYTES * 1e-9
    count = 1e-4 + 2 * INDEX_BYTES * 1e-9
    weights = np.array([10.0, 20.0]) * 4 * 4 * 1e-9  # with the rows: bytes only
    assert np.allclose(f, count + entries + weights) and np.allclose(b, weights)
    f2, b2 = one_copy_overhead_s(c, sent, ranks_per_node=2, top_k=4, weight_bytes=4, degrees=(2, 1))
    assert np.allclose(f2 - f, 1e-4) and np.allclose(b2 - b, 1e-4)  # their own all-to-all each way


def test_taken_when_the_rows_it_saves_cost_more_than_what_it_adds():
    common = dict(ranks_per_node=2, token_bytes=4096, weight_bytes=4, degrees=(1, 1))
    assert choose_one_copy(costs(1e-5, 1e-9), CROWDED, top_k=4, **common)  # wide rows, cheap startups
    assert not choose_one_copy(costs(1e-1, 1e-9), CROWDED, top_k=4, **common)  # startups dominate
    assert not choose_one_copy(costs(1e-5, 1e-9), CROWDED, top_k=1, **common)  # k = 1: nothing shared
    # narrow rows: the K routing entries and weights per row outweigh the rows saved
    assert not choose_one_copy(costs(0.0, 1e-9), CROWDED, top_k=2, ranks_per_node=2, token_bytes=8, weight_bytes=4,
                               degrees=(1, 1))


def test_simulator_takes_the_runtimes_decision():
    """Per group, "auto" prices the layer as forced on where choose_one_copy (called here as the
    runtime calls it) takes one copy per destination, and as forced off elsewhere; both occur."""
    hw = Hardware(flops=100e12, intra_bw=200e9, inter_bw=25e9, latency=10e-6, hbm_bw=2e12)
    shape = ExpertShape(hidden=512, ffn=2048)
    rng = np.random.default_rng(0)
    traffic_BNN = rng.integers(0, 4000, (8, 4, 4)).astype(np.float64)
    traffic_BNN[:4] *= np.eye(4) * 0.01 + (1 - np.eye(4))  # few rows stay: crowded destinations
    traffic_BNN[4:] *= np.eye(4) + (1 - np.eye(4)) * 0.001  # almost all stay: little to share
    lts = {d: LayerSchedule(hw, shape, ranks_per_node=2, top_k=4, options=ScheduleOptions(dedup=d)).layer(traffic_BNN)
           for d in ("auto", True, False)}
    c = schedule_costs(hw, shape)
    taken = []
    for b in range(8):
        want = choose_one_copy(c, traffic_BNN[b], ranks_per_node=2, token_bytes=shape.token_bytes, top_k=4,
                               weight_bytes=shape.param_bytes, degrees=tuple(lts["auto"].degrees[b]), relay=True)
        ref = lts[want]
        assert lts["auto"].forward_B[b] == ref.forward_B[b] and lts["auto"].backward_B[b] == ref.backward_B[b], b
        assert np.array_equal(lts["auto"].links.rank_BN[b], ref.links.rank_BN[b]), b
        taken.append(want)
    assert set(taken) == {True, False}
    # two hops save bytes across nodes and add some inside them: the sum need not grow with groups
    assert lts[False].saved_bytes == 0 != lts["auto"].saved_bytes != lts[True].saved_bytes


def test_two_hops_across_nodes_can_lose_what_one_hop_gains():
    """Across nodes the runtime's one copy per destination runs as two hops (``relay``): the relays
    forward inside the node what one hop sends across it, so where the link inside the node is the
    slower one, the hop it adds costs more than the node link saves, chunked or not. One node:
    nothing to relay, the same decision."""
    c = ScheduleCosts(a2a_intra=Linear(1e-5, 5e-11), a2a_inter=Linear(1e-5, 2e-12), gemm=Linear(1e-5, 1e-7),
                      concurrent=True)
    t = np.random.default_rng(1).integers(0, 4000, (8, 8)).astype(float)
    for degrees in ((1, 1), (4, 4)):
        kw = dict(ranks_per_node=4, token_bytes=4096, top_k=4, weight_bytes=2, degrees=degrees)
        assert choose_one_copy(c, t, **kw) and not choose_one_copy(c, t, relay=True, **kw)
        one_node = dict(kw, ranks_per_node=8)
        assert choose_one_copy(c, t, **one_node) == choose_one_copy(c, t, relay=True, **one_node)


def test_choose_exchange_prices_the_exchange_that_runs():
    """choose_exchange picks each direction's degree over the loads of the exchange that would run
    (one copy per destination on: its rows; across nodes: the two hops' relay_loads), and under
    "auto" the candidate with the least forward + backward (overheads included); by hand."""
    from ds_fssdp.planner.onecopy import choose_exchange, relay_loads
    from ds_fssdp.planner.schedule import choose_degrees, loads_from_traffic, pipeline_times
    c = ScheduleCosts(a2a_intra=Linear(1e-5, 1e-10), a2a_inter=Linear(2e-5, 1e-9), gemm=Linear(1e-5, 1e-6),
                      concurrent=True)
    t = np.random.default_rng(3).integers(0, 4000, (8, 8)).astype(float)
    kw = dict(ranks_per_node=4, token_bytes=4096, top_k=4, weight_bytes=2)
    sent = t * distinct_fraction(t, 4)
    two = relay_loads(t, ranks_per_node=4, token_bytes=4096, top_k=4, sent_DD=sent)
    plain = loads_from_traffic(t, ranks_per_node=4, token_bytes=4096)
    assert choose_exchange(c, t, one_copy=True, relay=True, **kw) == (choose_degrees(c, two), True)
    assert choose_exchange(c, t, one_copy=False, relay=True, **kw) == (choose_degrees(c, plain), False)
    assert choose_degrees(c, two) != choose_degrees(c, plain)  # the relay's pipeline wants other degrees

    def layer(loads, deg, over=(0.0, 0.0)):
        return float((pipeline_times(c, loads, deg[0]) + over[0] + pipeline_times(c, loads, deg[1], backward=True)
                      + over[1]).max())
    d_on, d_off = choose_degrees(c, two), choose_degrees(c, plain)
    on = layer(two, d_on, one_copy_overhead_s(c, sent, ranks_per_node=4, top_k=4, weight_bytes=2, degrees=d_on))
    want = (d_on, True) if on < layer(plain, d_off) else (d_off, False)
    assert choose_exchange(c, t, one_copy="auto", relay=True, **kw) == want
    assert choose_exchange(c, t, one_copy="auto", relay=True, degrees=(2, 3), **kw)[0] == (2, 3)

"""planner.schedule.loads_from_plan: the per-rank loads of the pipeline's degree choice, counted
by hand on a small plan with a replicated expert and two nodes; relay_loads (two hops) counted
token by token, and the relay hop priced around the pipeline."""
import dataclasses

import numpy as np
import pytest

from ds_fssdp.planner.onecopy import distinct_fraction, relay_loads, relay_traffic
from ds_fssdp.planner.schedule import LayerLoad, Linear, ScheduleCosts, link_busy, pipeline_time


def test_loads_from_plan_hand_count():
    from ds_fssdp.planner.plan import DispatchPlan
    from ds_fssdp.planner.schedule import LayerLoad, choose_degrees, loads_from_plan
    # 4 ranks, 2 nodes {0, 1} {2, 3}; experts 0 -> rank 0, 1 -> rank 2, 2 -> rank 3; expert 3 replicated
    # on ranks 1 and 2: rank 0 sends it 2 tokens to rank 1 and 1 to rank 2; rank 3 sends 4 to rank 2.
    tokens_ED = np.array([[3, 1, 0, 2], [0, 2, 5, 1], [1, 0, 0, 0], [3, 0, 0, 4]], dtype=np.int64)
    plan = DispatchPlan(tokens_ED=tokens_ED, holder_E=np.array([0, 2, 3, -1]), rep_X=np.array([3]),
                        flows_4F=np.array([[0, 0, 0], [1, 2, 2], [0, 0, 3], [2, 1, 4]]))
    # traffic[d, h]: d=0: 3 stay, 1 -> r3 (e2), 2 -> r1, 1 -> r2 (e3); d=1: 1 -> r0, 2 -> r2;
    # d=2: 5 stay; d=3: 2 -> r0, 1 -> r2, 4 -> r2.
    traffic = plan.traffic_DD().numpy()
    assert traffic.tolist() == [[3, 2, 1, 1], [1, 0, 2, 0], [0, 0, 5, 0], [2, 0, 5, 0]]
    loads = loads_from_plan(plan, ranks_per_node=2, token_bytes=10)
    # intra: r0 sends 2 (to r1), receives 1 (from r1); r1 sends 1, receives 2; r2 sends 0, receives 5
    # (from r3); r3 sends 5, receives 0. Node 0 sends 1+1+2 = 4 across, receives 2+0 = 2 (r3 -> r0);
    # node 1 sends 2, receives 4. One collective: every rank gets the busiest links' bytes (intra 5
    # rows: r2 / r3; inter 4 rows: either node).
    assert loads == [LayerLoad(50.0, 40.0, 3.0, 3.0), LayerLoad(50.0, 40.0, 0.0, 2.0),
                     LayerLoad(50.0, 40.0, 5.0, 8.0), LayerLoad(50.0, 40.0, 0.0, 1.0)]
    # One node: every cross-rank row is intra, no inter bytes.
    one = loads_from_plan(plan, ranks_per_node=4, token_bytes=1)
    assert [ld.inter_bytes for ld in one] == [0.0] * 4
    assert [ld.intra_bytes for ld in one] == [8.0] * 4  # r2 receives 1 + 2 + 5
    with pytest.raises(ValueError, match="ranks_per_node"):
        loads_from_plan(plan, ranks_per_node=3, token_bytes=1)
    f, b = choose_degrees(_costs(), loads)
    assert 1 <= f <= 8 and 1 <= b <= 8


def _costs():
    from ds_fssdp.planner.schedule import Linear, ScheduleCosts
    return ScheduleCosts(a2a_intra=Linear(1e-5, 1e-9), a2a_inter=Linear(1e-5, 1e-8), gemm=Linear(1e-6, 1e-6))


def test_pipeline_times_equal_the_scalar_function_exactly():
    from ds_fssdp.planner.schedule import LayerLoad, Linear, ScheduleCosts, pipeline_time, pipeline_times
    rng = np.random.default_rng(3)
    costs = ScheduleCosts(a2a_intra=Linear(1e-5, 5e-12), a2a_inter=Linear(2e-5, 4e-11), gemm=Linear(3e-6, 2e-8),
                          backward_factor=2.0)
    loads = [LayerLoad(float(i), float(e), float(l), float(r))
             for i, e, l, r in rng.integers(0, 3, (40, 4)) * rng.integers(0, 10**6, (40, 4))]
    for n in range(1, 9):
        for backward in (False, True):
            got = pipeline_times(costs, loads, n, backward=backward)
            assert got.tolist() == [pipeline_time(costs, ld, n, backward=backward) for ld in loads]


def test_the_schedule_in_c_is_the_python_reference_bit_for_bit(monkeypatch):
    """Under concurrent costs pipeline_times and choose_degrees run in C (_fastplan): every load's
    time at every degree, both directions, one hop and two (with side work), is the Python
    reference's number bit for bit, and the degrees are the reference's search (the slowest rank's
    time, least over degrees, a relative 1e-9 to win), loads given as LayerLoads or columns."""
    from ds_fssdp.planner import schedule
    if schedule._fastplan is None:
        pytest.skip("the planner's C extension is not built")
    rng = np.random.default_rng(5)
    for trial in range(60):
        costs = ScheduleCosts(a2a_intra=Linear(*rng.uniform([0, 1e-12], [3e-5, 1e-9])),
                              a2a_inter=Linear(*rng.uniform([0, 1e-12], [3e-5, 1e-8])),
                              gemm=Linear(*rng.uniform([0, 1e-10], [1e-5, 1e-7])), backward_factor=rng.uniform(1, 3))
        relay = float(rng.uniform(0, 1e8)) if trial % 2 else 0.0
        inter = 0.0 if relay or trial % 4 == 2 else float(rng.uniform(0, 1e8))
        rows = rng.integers(0, 5000, (int(rng.integers(1, 70)), 3)).astype(float)
        loads = [LayerLoad(float(rng.uniform(0, 1e8)) if i == 0 else 2e7, inter, r[0], r[1], relay_bytes=relay,
                           side_rows=r[2] if trial % 3 else 0.0) for i, r in enumerate(rows)]
        got = {(n, bw): schedule.pipeline_times(costs, loads, n, backward=bw) for n in range(1, 12)
               for bw in (False, True)}
        degrees = schedule.choose_degrees(costs, loads)
        assert schedule.choose_degrees(costs, schedule.load_columns(loads)) == degrees
        with monkeypatch.context() as m:
            m.setattr(schedule, "_fastplan", None)
            for (n, bw), times in got.items():
                assert times.tolist() == schedule.pipeline_times(costs, loads, n, backward=bw).tolist()
            assert schedule.choose_degrees(costs, loads) == degrees
        want = []
        for bw in (False, True):
            pick = 1
            for n in range(2, 9):
                if got[n, bw].max() < got[pick, bw].max() * (1.0 - 1e-9):
                    pick = n
            want.append(pick)
        assert degrees == tuple(want)


def test_other_traffic_is_priced_only_without_concurrency():
    """A layer's other collectives in flight (LayerLoad.other_*_bytes: the replicas' gather and
    reduce) cost nothing with concurrent costs (the idle link; every concurrent caller unchanged),
    and add one fitted exchange of their bytes to that direction, at every degree, when not."""
    import dataclasses

    from ds_fssdp.planner.schedule import (LayerLoad, Linear, ScheduleCosts, choose_degrees, idle_link_s, layer_time,
                                           other_traffic_s, pipeline_time, pipeline_times)
    conc = ScheduleCosts(a2a_intra=Linear(1e-5, 5e-10), a2a_inter=Linear(2e-5, 4e-9), gemm=Linear(3e-6, 2e-8),
                         backward_factor=2.0)
    serial = dataclasses.replace(conc, concurrent=False)
    plain = LayerLoad(4e5, 1e5, 300.0, 900.0)
    other = dataclasses.replace(plain, other_fwd_intra_bytes=2e6, other_fwd_inter_bytes=1e5,
                                other_bwd_intra_bytes=0.0, other_bwd_inter_bytes=3e5)
    fwd_s = max(1e-5 + 5e-10 * 2e6, 2e-5 + 4e-9 * 1e5)  # exchange(2e6 intra, 1e5 inter): the intra part
    bwd_s = 2e-5 + 4e-9 * 3e5  # nothing intra: the inter part alone
    assert other_traffic_s(serial, other) == pytest.approx(fwd_s)
    assert other_traffic_s(serial, other, backward=True) == pytest.approx(bwd_s)
    assert other_traffic_s(conc, other) == other_traffic_s(conc, other, backward=True) == 0.0
    assert other_traffic_s(serial, plain) == other_traffic_s(serial, plain, backward=True) == 0.0
    for n in range(1, 5):
        for backward, extra in ((False, fwd_s), (True, bwd_s)):
            assert pipeline_time(conc, other, n, backward=backward) == pipeline_time(conc, plain, n, backward=backward)
            assert pipeline_time(serial, other, n, backward=backward) == pytest.approx(
                pipeline_time(serial, plain, n, backward=backward) + extra, rel=1e-12)
            got = pipeline_times(serial, [plain, other], n, backward=backward)
            assert got.tolist() == [pipeline_time(serial, ld, n, backward=backward) for ld in (plain, other)]
    assert layer_time(serial, other, (1, 1)) == pytest.approx(layer_time(serial, plain, (1, 1)) + fwd_s + bwd_s)
    # The decisions do not move: concurrent degrees equal the plain load's, non-concurrent stay (1, 1);
    # on non-concurrent costs the other traffic is link time, not a gap.
    assert choose_degrees(conc, [other]) == choose_degrees(conc, [plain])
    assert choose_degrees(serial, [other]) == (1, 1)
    assert idle_link_s(serial, other, 1) == pytest.approx(idle_link_s(serial, plain, 1))
    assert idle_link_s(conc, other, 2) == idle_link_s(conc, plain, 2)


def test_relay_loads_hand_count():
    """Two hops (several nodes of several ranks, one copy per destination): relay_loads against a
    count token by token of the runtime's route: d -> the rank of each destination node with d's
    local index (distinct tokens per node), then inside the node to each destination (distinct
    tokens per rank); rows whose relay is their destination land with the first hop. The local
    rows (computed first) are d's own tokens on its experts."""
    rng = np.random.default_rng(0)
    for D, G, k in ((8, 4, 2), (8, 2, 4), (12, 3, 2)):
        t = rng.integers(0, 50, (D, D)).astype(float)
        loads = relay_loads(t, ranks_per_node=G, token_bytes=3.0, top_k=k)
        n, node, loc = D // G, np.arange(D) // G, np.arange(D) % G
        sent = t * distinct_fraction(t, k)
        to_node = np.stack([t[:, node == m].sum(1) for m in range(n)], 1)
        frac = distinct_fraction(to_node, k)
        hop1, hop2, landed_D = np.zeros((D, D)), np.zeros((D, D)), np.diag(t).copy()
        for d in range(D):
            for m in range(n):
                if m != node[d]:
                    hop1[d, m * G + loc[d]] += to_node[d, m] * frac[d, m]
            for h in range(D):
                r = node[h] * G + loc[d]
                if r != h:
                    hop2[r, h] += sent[d, h]
                elif d != h:
                    landed_D[h] += t[d, h]
        out = np.array([hop1[node == m].sum() for m in range(n)])
        into = np.array([hop1[:, node == m].sum() for m in range(n)])
        assert all(ld.relay_bytes == pytest.approx(3.0 * max(out.max(), into.max())) for ld in loads)
        # the relay hop leaves a node only (d's relay in d's node is d: nothing crosses inside)
        assert all(node[r] != node[d] for d, r in zip(*np.nonzero(hop1)))
        assert all(node[r] == node[h] for r, h in zip(*np.nonzero(hop2)))
        assert all(ld.intra_bytes == pytest.approx(3.0 * max(hop2.sum(1).max(), hop2.sum(0).max())) for ld in loads)
        assert all(ld.inter_bytes == 0.0 for ld in loads)
        assert [ld.local_rows for ld in loads] == pytest.approx(np.diag(t))
        assert [ld.local_rows + ld.remote_rows for ld in loads] == pytest.approx(t.sum(0))
        rank_D, node_n, crossing, landed = relay_traffic(t, ranks_per_node=G, top_k=k)  # per link
        assert rank_D == pytest.approx(np.maximum(hop2.sum(1), hop2.sum(0)))
        assert node_n == pytest.approx(np.maximum(out, into)) and crossing == pytest.approx(hop1.sum())
        assert landed == pytest.approx(landed_D)


def _relay_events(r, x, g, c0, n):
    """The two-hop schedule at degree n >= 2 as ``moe/relay.py``'s loop issues it: the local GEMM
    (``c0``) first; per step t, relay chunk t + 1 (``r`` on the node link), chunk t's hop inside the
    node (``x`` on the rank link) once its relay chunk has landed, chunk t - 1's GEMM (``g``) once
    its hop has, its hop back, and chunk t - 2's relay return once its hop back has. Each resource
    runs its operations in issue order."""
    res = {"inter": 0.0, "intra": 0.0, "compute": c0}

    def run(where, dur, ready):
        res[where] = max(res[where], ready) + dur
        return res[where]
    R, I, C, J = {0: run("inter", r, 0.0)}, {}, {}, {}
    for t in range(n + 2):
        if t < n:
            if t + 1 < n:
                R[t + 1] = run("inter", r, 0.0)
            I[t] = run("intra", x, R[t])
        if 1 <= t <= n:
            C[t - 1] = run("compute", g, I[t - 1])
            J[t - 1] = run("intra", x, C[t - 1])
        if t >= 2:
            run("inter", r, J[t - 2])
    return max(res["inter"], res["compute"])


def test_relay_hop_chunked_with_the_pipeline():
    """At degree 1 the relay hop and its return are unchunked exchanges on the node link around
    the exchange inside the node. At degree n >= 2 both hops are chunked (``moe/relay.py``): the
    local rows first, then each chunk through its relay hop, hop inside the node, GEMM, hop back
    and relay return, in the runtime's issue order; serial costs: the sum of the parts.
    The links carry n chunks each way. With a relay hop as long as the GEMM, chunking it is faster."""
    costs = ScheduleCosts(a2a_intra=Linear(1e-5, 1e-9), a2a_inter=Linear(2e-5, 4e-9), gemm=Linear(3e-5, 1e-6))
    serial = dataclasses.replace(costs, concurrent=False)
    base = LayerLoad(intra_bytes=4e5, inter_bytes=0.0, local_rows=300.0, remote_rows=900.0)
    relay = dataclasses.replace(base, relay_bytes=2e5)
    for c in (costs, serial):
        for backward in (False, True):
            f = c.backward_factor if backward else 1.0
            assert pipeline_time(c, relay, 1, backward=backward) == pytest.approx(
                pipeline_time(c, base, 1, backward=backward) + 2.0 * c.a2a_inter(2e5), rel=1e-12)
            for n in (2, 3, 8):
                r, x = c.a2a_inter(2e5 / n), c.a2a_intra(4e5 / n)
                g, c0 = f * c.gemm(900.0 / n), f * c.gemm(300.0)
                want = _relay_events(r, x, g, c0, n) if c.concurrent else 2.0 * n * (r + x) + n * g + c0
                assert pipeline_time(c, relay, n, backward=backward) == pytest.approx(want, rel=1e-12), (n, backward)
        for n in (1, 2, 3, 8):
            hop = 2.0 * c.a2a_inter(2e5) if n == 1 else 2.0 * n * c.a2a_inter(2e5 / n)
            assert link_busy(c, relay, n)[1] == pytest.approx(link_busy(c, base, n)[1] + hop, rel=1e-12)
            assert link_busy(c, relay, n)[0] == link_busy(c, base, n)[0]
    even = dataclasses.replace(relay, relay_bytes=3e5)  # a relay hop about as long as the GEMM
    assert pipeline_time(costs, even, 4) < 0.7 * pipeline_time(costs, even, 1)


def _full_search(costs, loads, backward):
    """choose_degrees' rule with every candidate priced at every degree (what its early exit skips)."""
    from ds_fssdp.planner.schedule import MAX_DEGREE, pipeline_times
    pick, pick_s = 1, None
    for n in range(1, MAX_DEGREE + 1):
        s = float(pipeline_times(costs, loads, n, backward=backward).max())
        if pick_s is None or s < pick_s * (1.0 - 1e-9):
            pick, pick_s = n, s
    return pick


@pytest.mark.parametrize("seed", range(8))
def test_the_degree_search_stopping_a_degree_early_takes_the_full_searchs_degrees(seed):
    """choose_degrees stops pricing a degree once one rank is as slow as the best so far (and
    prices the last slowest rank first): the degrees are the full search's, over random costs,
    one hop and two, near ties (many equal loads) included."""
    from ds_fssdp.planner.schedule import choose_degrees
    rng = np.random.default_rng(seed)
    costs = ScheduleCosts(a2a_intra=Linear(10 ** rng.uniform(-6, -4), 10 ** rng.uniform(-12, -10)),
                          a2a_inter=Linear(10 ** rng.uniform(-6, -4), 10 ** rng.uniform(-11, -9)),
                          gemm=Linear(10 ** rng.uniform(-7, -5), 10 ** rng.uniform(-9, -7)), backward_factor=2.0)
    for relay in (0.0, float(rng.uniform(1e6, 1e8))):
        rows = rng.integers(0, 60, (32, 2)) * 100
        rows[rng.integers(0, 32, 8)] = rows[0]  # equal loads
        loads = [LayerLoad(float(rng.uniform(1e6, 1e8)) if i % 3 else 5e7, 0.0 if relay else 1e7, float(lo),
                           float(re), relay_bytes=relay, side_rows=float(rng.integers(0, 2) * 500))
                 for i, (lo, re) in enumerate(rows)]
        assert choose_degrees(costs, loads) == (_full_search(costs, loads, False), _full_search(costs, loads, True))

"""The schedule's cost model fit (planner.schedule.fit_linear / fit_schedule_costs) and the layer
timings it is refitted from (moe.timing): pure, single process."""
import numpy as np
import pytest
import torch

from ds_fssdp.moe.timing import LayerTimings
from ds_fssdp.planner.schedule import Linear, fit_linear, fit_schedule_costs


@pytest.mark.parametrize("startup,rate", [(50e-6, 2e-9), (0.0, 1e-9), (1e-3, 0.0)])
def test_fit_linear_recovers_startup_and_rate_from_noisy_timings(startup, rate):
    rng = np.random.default_rng(0)
    units = np.repeat([1e4, 1e5, 1e6, 4e6], 8)
    seconds = (startup + rate * units) * rng.uniform(0.97, 1.03, units.size) + 1e-12
    fit, err = fit_linear(units, seconds)
    scale = startup + rate * units.max()
    assert abs(fit.startup_s - startup) <= 0.05 * scale
    assert abs(fit.per_unit_s - rate) * units.max() <= 0.05 * scale  # the rate's share at the largest size
    if rate:
        assert fit.per_unit_s == pytest.approx(rate, rel=0.05)
    assert 0.0 < err < 0.05


def test_fit_linear_error_reports_a_bad_fit():
    """Timings that are not linear in the units: the relative error says so."""
    _, err = fit_linear([1, 2, 3, 4, 5, 6], [1.0, 0.1, 1.0, 0.1, 1.0, 0.1])
    assert err > 0.3


def test_fit_schedule_costs_recovers_every_part():
    rng = np.random.default_rng(1)
    intra, inter, gemm, back = Linear(30e-6, 1e-9), Linear(200e-6, 8e-9), Linear(10e-6, 4e-7), 2.4
    noise = lambda: float(rng.uniform(0.98, 1.02))
    b = [1e4, 1e5, 5e5, 2e6]
    r = [16, 64, 256, 1024]
    costs, err = fit_schedule_costs([(x, intra(x) * noise()) for x in b], [(x, inter(x) * noise()) for x in b],
                                    [(x, gemm(x) * noise()) for x in r], [(x, back * gemm(x) * noise()) for x in r])
    for got, want in ((costs.a2a_intra, intra), (costs.a2a_inter, inter), (costs.gemm, gemm)):
        assert got.per_unit_s == pytest.approx(want.per_unit_s, rel=0.05)
        assert got.startup_s == pytest.approx(want.startup_s, abs=0.05 * want(b[-1] if want is not gemm else r[-1]))
    assert costs.backward_factor == pytest.approx(back, rel=0.03)
    assert 0.0 < err < 0.05  # 2% noise on both the forward and the backward samples
    # One node: the inter-node link takes the intra-node fit; too few samples is an error that says what.
    one, _ = fit_schedule_costs([(x, intra(x)) for x in b], [], [(x, gemm(x)) for x in r], [(x, gemm(x)) for x in r])
    assert one.a2a_inter == one.a2a_intra
    with pytest.raises(ValueError, match="gemm_backward"):
        fit_schedule_costs([(x, intra(x)) for x in b], [], [(x, gemm(x)) for x in r], [(16, 1e-3)])


def test_link_bytes_split_by_node_and_exclude_self():
    t = LayerTimings(rank=1, ranks_per_node=2)
    # Ranks 0, 1 on node 0; 2, 3 on node 1. Send / receive rows per peer.
    intra, inter = t.link_bytes([5, 100, 3, 4], [6, 100, 1, 9], row_bytes=8)
    assert (intra, inter) == (max(5, 6) * 8, max(3 + 4, 1 + 9) * 8)


def test_timed_spans_record_forward_and_backward_and_keep_values():
    t = LayerTimings(rank=0, ranks_per_node=1)
    x = torch.randn(7, 3, requires_grad=True)
    y = t.expert_fn(lambda xg, sizes: xg * 2.0)(x, [7])
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    (units_f, s_f), = t.samples("gemm_fwd")
    (units_b, s_b), = t.samples("gemm_bwd")
    assert units_f == units_b == (7.0,) and s_f >= 0 and s_b >= 0
    with torch.no_grad():  # no graph: a forward span only
        t.expert_fn(lambda xg, sizes: xg)(x, [7])
    assert len(t.samples("gemm_fwd")) == 2 and len(t.samples("gemm_bwd")) == 1


def _gpu_arms():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "schedule_arms.py"
    spec = importlib.util.spec_from_file_location("schedule_arms", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_schedule_arms_skip_without_cuda_and_run_their_logic_on_cpu(tmp_path, monkeypatch):
    """benchmarks/gpu/schedule_arms.py: no CUDA -> a clean skip; --device cpu runs the same schedule
    code serially (tiny shapes): every degree measured, auto chosen in range by the fitted model,
    one copy per destination sends no more rows than one per assignment (its rows are checked
    equal inside the arm)."""
    import json
    import sys
    arms = _gpu_arms()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["schedule_arms.py", "--json", str(tmp_path / "skip.json")])
    assert arms.main() == 0
    assert json.loads((tmp_path / "skip.json").read_text()) == {"skipped": "no CUDA device"}
    monkeypatch.setattr(sys, "argv", ["schedule_arms.py", "--device", "cpu", "--repeats", "1", "--json",
                                      str(tmp_path / "cpu.json")])
    assert arms.main() == 0
    out = json.loads((tmp_path / "cpu.json").read_text())
    for fam in ("mixtral", "deepseek"):
        p, d = out["pipeline"][fam], out["dedup"][fam]
        for direction in ("forward", "backward"):
            assert sorted(map(int, p[direction]["measured_ms"])) == list(range(1, 9))
            assert 1 <= p[direction]["auto_degree"] <= 8
        assert p["local_rows"] + p["remote_rows"] == p["rows"]
        assert 0 < d["rows_on"] < d["rows_off"] and d["bytes_saved_fraction"] > 0


def test_timed_layer_output_may_be_modified_in_place():
    """The span's output is the call's own tensor, so code after the layer may modify it in place."""
    t = LayerTimings(rank=0, ranks_per_node=1)
    x = torch.randn(4, 3, requires_grad=True)
    y = t.timed(lambda v: v * 3.0, x, (4.0,), "gemm_fwd", "gemm_bwd")
    y.add_(1.0)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0)) and len(t.samples("gemm_bwd")) == 1


def test_compute_span_is_the_layer_span_less_its_exchanges():
    """A layer of exchange -> compute -> exchange: compute_fwd/bwd = layer span - the exchanges in it."""
    import time as _time

    class Route:
        send_splits, recv_splits = [3, 5], [3, 4]

    t = LayerTimings(rank=0, ranks_per_node=2)

    def slow(v, s):
        _time.sleep(s)
        return v * 1.0

    def body(x):
        x = t.exchange(lambda v: slow(v, 0.02), x, [3, 4], [3, 5])
        x = t.expert_fn(lambda v, sizes: slow(v, 0.01))(x, [7])
        return t.exchange(lambda v: slow(v, 0.02), x, [3, 5], [3, 4])

    x = torch.randn(7, 2, requires_grad=True)
    t.layer(body, x, Route()).sum().backward()
    (units, layer_s), = t.samples("layer_fwd")
    # intra bytes: max(5 sent, 4 received) rows of 8 bytes; rows 3 + 4; no other collectives in flight
    assert units == (5 * 8.0, 0.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0)
    (rows, compute_s), = t.samples("compute_fwd")
    a2a_fwd = sum(s for _, s in t.samples("a2a")[:2])
    assert rows == (7.0,) and compute_s == pytest.approx(layer_s - a2a_fwd, abs=1e-9)
    assert 0.009 < compute_s < layer_s - 0.04
    (_, compute_b), = t.samples("compute_bwd")
    (_, layer_b), = t.samples("layer_bwd")
    assert len(t.samples("a2a")) == 4 and compute_b == pytest.approx(layer_b - sum(s for _, s in t.samples("a2a")[2:]),
                                                                    abs=1e-9)


def test_layer_units_carry_the_other_collectives_bytes_as_a_layer_load():
    """The whole-layer spans' units end with the other collectives' bytes the caller passes
    (forward intra, inter, backward intra, inter) and are a LayerLoad's fields in its order."""
    from ds_fssdp.planner.schedule import LayerLoad

    class Route:
        send_splits, recv_splits = [3, 5], [3, 4]

    t = LayerTimings(rank=0, ranks_per_node=2)
    x = torch.randn(7, 2, requires_grad=True)
    t.layer(lambda v: v * 2.0, x, Route(), other=lambda: (100.0, 0.0, 60.0, 5.0)).sum().backward()
    (units_f, _), = t.samples("layer_fwd")
    (units_b, _), = t.samples("layer_bwd")
    assert units_f == units_b == (40.0, 0.0, 3.0, 4.0, 100.0, 0.0, 60.0, 5.0)
    assert LayerLoad(*units_f) == LayerLoad(40.0, 0.0, 3.0, 4.0, other_fwd_intra_bytes=100.0, other_fwd_inter_bytes=0.0,
                                            other_bwd_intra_bytes=60.0, other_bwd_inter_bytes=5.0)
    with pytest.raises(ValueError, match="other"):
        t.layer(lambda v: v, x, Route(), other=lambda: (1.0, 2.0))


def test_sharded_other_bytes_are_the_next_layers_early_gather_first_phase():
    """moe/sharded.py ShardedExperts._other_bytes: the forward carries the first phase of the next
    layer's gather when this forward started it and it has not landed (link_bytes of its splits,
    whole expert rows), else nothing; the backward nothing (the replica reduce starts after the span)."""
    from types import SimpleNamespace as NS

    from ds_fssdp.moe.sharded import ShardedExperts
    phase = NS(send_splits=[0, 2, 1, 0], recv_splits=[0, 1, 0, 3])  # rank 1 of ranks {0, 1}, {2, 3}
    second = NS(send_splits=[9, 9, 9, 9], recv_splits=[9, 9, 9, 9])  # a later (intra-node) phase: not in flight
    gather = NS(in_flight=True)
    nxt = NS(_gather=(None, -1, NS(phases=[phase, second]), gather), expert_bytes=100)
    me = NS(timings=LayerTimings(rank=1, ranks_per_node=2), next=nxt)
    # intra: rank 0 sends and receives nothing (rank 1 is self); inter: max(1 sent, 3 received) rows
    assert ShardedExperts._other_bytes(me, True) == (0.0, 300.0, 0.0, 0.0)
    assert ShardedExperts._other_bytes(me, False) == (0.0, 0.0, 0.0, 0.0)
    gather.in_flight = False  # landed before the span started
    assert ShardedExperts._other_bytes(me, True) == (0.0, 0.0, 0.0, 0.0)
    nxt._gather = (None, -1, NS(phases=[]), NS(in_flight=False))  # nothing to gather
    assert ShardedExperts._other_bytes(me, True) == (0.0, 0.0, 0.0, 0.0)

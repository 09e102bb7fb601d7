"""Work beside the exchange (``moe/side.py``): a block's shared experts computed inside its chunked
token exchange, priced by the schedule (``LayerLoad.side_rows``).

* The schedule: in sequence at degree 1 (and on serial costs), hidden behind the last combine
  (one hop) or the last relay return (two hops) above it; it can move the chosen degree.
* The binding: only blocks that run their shared experts after their experts bind; the block's
  call gets the delivered output for the input it was computed on, and computes otherwise.
* The simulator charges it in every layer (the serial policies as before, in sequence).

On gloo ranks: ``test_side_work_training.py`` (HF families), ``test_pipeline_dedup.py`` (two hops).
"""
import dataclasses

import numpy as np
import pytest
import torch

from ds_fssdp.planner.onecopy import price_exchange, side_rows
from ds_fssdp.planner.schedule import LayerLoad, Linear, ScheduleCosts, choose_degrees, pipeline_time

COSTS = ScheduleCosts(a2a_intra=Linear(1e-4, 1e-9), a2a_inter=Linear(2e-4, 4e-9), gemm=Linear(0.0, 1e-6))


def _with_side(load, rows):
    return dataclasses.replace(load, side_rows=float(rows))


def test_side_work_runs_in_sequence_at_degree_one_and_on_serial_costs():
    load = LayerLoad(intra_bytes=4e5, inter_bytes=0.0, local_rows=300.0, remote_rows=900.0)
    side = 500.0
    for backward, factor in ((False, 1.0), (True, COSTS.backward_factor)):
        base = pipeline_time(COSTS, load, 1, backward=backward)
        got = pipeline_time(COSTS, _with_side(load, side), 1, backward=backward)
        assert got == pytest.approx(base + factor * side * 1e-6, rel=1e-12)
    serial = dataclasses.replace(COSTS, concurrent=False)
    for n in (1, 2, 4):
        base = pipeline_time(serial, load, n)
        assert pipeline_time(serial, _with_side(load, side), n) == pytest.approx(base + side * 1e-6, rel=1e-12)


def test_side_work_hides_behind_the_last_combine_above_degree_one():
    """A link-bound layer: the last chunk's GEMM ends when dispatch n has landed (link operation
    2n - 2) plus its GEMM; the links still carry the combines after it, and the side work hides
    there, up to that slack and no further."""
    load = LayerLoad(intra_bytes=4e6, inter_bytes=0.0, local_rows=100.0, remote_rows=800.0)
    n = 4
    chunk = COSTS.a2a_intra(4e6 / n)
    base = pipeline_time(COSTS, load, n)
    computed = (2 * n - 2) * chunk + 800.0 / n * 1e-6  # the last chunk's GEMM ends
    slack = base - computed
    assert slack >= chunk  # at least the last combine
    assert pipeline_time(COSTS, _with_side(load, 0.9 * slack / 1e-6), n) == pytest.approx(base, rel=1e-12)
    assert pipeline_time(COSTS, _with_side(load, (slack + 1e-3) / 1e-6), n) == pytest.approx(base + 1e-3, rel=1e-9)
    # two hops: behind the last relay return
    relay = LayerLoad(intra_bytes=1e6, inter_bytes=0.0, local_rows=100.0, remote_rows=800.0, relay_bytes=4e6)
    r_chunk = COSTS.a2a_inter(4e6 / n)
    base = pipeline_time(COSTS, relay, n)
    assert pipeline_time(COSTS, _with_side(relay, 0.9 * r_chunk / 1e-6), n) == pytest.approx(base, rel=1e-12)
    assert pipeline_time(COSTS, _with_side(relay, base / 1e-6), n) > base  # more than the whole layer


def test_side_work_can_move_the_degree():
    """Startups so dear that degree 1 wins alone; work beside the exchange that only a chunked
    exchange hides makes degree 2 win."""
    costs = ScheduleCosts(a2a_intra=Linear(1.0, 0.0), a2a_inter=Linear(1.0, 0.0), gemm=Linear(0.0, 1e-3))
    load = LayerLoad(intra_bytes=1.0, inter_bytes=0.0, local_rows=0.0, remote_rows=100.0)
    assert choose_degrees(costs, [load], max_degree=2) == (1, 1)
    assert choose_degrees(costs, [_with_side(load, 3000.0)], max_degree=2)[0] == 2


def test_side_rows_are_each_ranks_tokens_times_the_ratio():
    traffic = np.array([[4.0, 2.0], [0.0, 6.0]])
    np.testing.assert_allclose(side_rows(traffic, 2, 1.5), [4.5, 4.5])
    assert side_rows(traffic, 2, 0.0) is None
    with pytest.raises(ValueError, match="side_ratio"):
        side_rows(traffic, 2, -1.0)
    price = price_exchange(COSTS, traffic * 100, ranks_per_node=2, token_bytes=64.0, top_k=2, weight_bytes=4.0,
                           one_copy=False, relay=False, side_ratio=1.5)
    assert [ld.side_rows for ld in price.loads] == [450.0, 450.0]


def test_the_binding_delivers_only_for_the_input_it_computed():
    import torch.nn as nn

    from ds_fssdp.moe.side import SharedSide, side_ratio

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4))
    assert side_ratio(mlp, hidden=4, ffn=3, matrices=2) == pytest.approx(48 / 24)
    calls = []
    own = mlp.forward
    side = SharedSide(mlp, 2.0)
    side._forward = lambda x: calls.append(x) or own(x)
    x = torch.randn(2, 3, 4)
    # trainable weights, no gradient into the input: the layer's Function could not carry theirs
    assert side.work(x.view(-1, 4)) is None
    x.requires_grad_(True)
    work = side.work(x.view(-1, 4))
    y = work.fn(work.x_TH)
    work.deliver(y.detach() + 1.0)  # what the layer hands over (marked so it can be told apart)
    torch.testing.assert_close(mlp(x), own(x) + 1.0)  # delivered, in the block's shape
    assert len(calls) == 1
    torch.testing.assert_close(mlp(x), own(x))  # once: the next call computes
    work = side.work(x.view(-1, 4))
    work.deliver(work.fn(work.x_TH))
    calls.clear()
    with torch.no_grad():
        x.add_(1.0)  # changed in place since: another input than the work's
    torch.testing.assert_close(mlp(x), own(x))  # computed as written
    # and no more side work from then on (a block that calls it on another input than its experts')
    assert len(calls) == 1 and side.missed
    assert side.work(x.view(-1, 4)) is None
    side.release()
    assert "forward" not in mlp.__dict__
    # bound in its block: no side work once another module sits where the block calls it
    block = nn.Module()
    block.shared_experts = mlp
    side = SharedSide(mlp, 2.0, site=(block, "shared_experts"))
    assert side.work(x.view(-1, 4)) is not None
    block.shared_experts = nn.Sequential(block.shared_experts)  # e.g. PEFT's modules_to_save wrapper
    assert side.work(x.view(-1, 4)) is None


def test_the_simulator_charges_the_shared_experts_in_every_layer():
    from ds_fssdp.planner.cost import ExpertShape, Hardware
    from ds_fssdp.sim.pipeline import SERIAL, LayerSchedule, ScheduleOptions

    hw = Hardware(flops=1e12, intra_bw=1e10, inter_bw=1e9, latency=1e-5)
    shape = ExpertShape(hidden=64, ffn=128, matrices=3)
    gen = np.random.default_rng(0)
    traffic = gen.multinomial(600, np.full(8, 1 / 8), size=8)[None].astype(np.float64)  # 300 tokens a rank
    per_token = 3.0 * shape.row_flops / hw.flops  # forward + backward of one row
    for options in (SERIAL, ScheduleOptions()):
        plain = LayerSchedule(hw, shape, ranks_per_node=4, top_k=2, options=options).layer(traffic)
        side = LayerSchedule(hw, shape, ranks_per_node=4, top_k=2, options=options, side_ratio=1.0).layer(traffic)
        np.testing.assert_allclose(side.side_B, traffic[0].sum(1).max() / 2 * per_token)
        np.testing.assert_array_equal(side.moe_B, plain.moe_B)
        total, base = side.forward_B + side.backward_B, plain.forward_B + plain.backward_B
        if options is SERIAL:  # in sequence: exactly its compute more
            np.testing.assert_allclose(total, base + side.side_B, rtol=1e-12)
        else:  # beside the exchange: never more than in sequence
            assert np.all(total <= base + side.side_B * (1 + 1e-12))

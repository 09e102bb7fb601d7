"""The schedule's pure functions for gradients in the gaps and replicas on the idle link
(planner/schedule.py): the link's idle time in a layer's modelled schedule, the EDP reduce's slice
size from it, one rank's load from a plan's traffic, the overlap window; and the cost model's
linear costs they are fed with (planner/cost.py)."""
import numpy as np
import pytest
import torch

from ds_fssdp.planner.cost import CostModel, ExpertShape, Hardware
from ds_fssdp.planner.schedule import (DEFAULT_GAP_SLICE_BYTES, MIN_GAP_SLICE_BYTES, LayerLoad, Linear,
                                       ScheduleCosts, gap_slice_bytes, idle_link_s, link_busy_s, overlap_window,
                                       pipeline_time, loads_from_traffic)
from ds_fssdp.topology import Topology

COSTS = ScheduleCosts(a2a_intra=Linear(1e-5, 1e-9), a2a_inter=Linear(2e-5, 4e-9), gemm=Linear(0.0, 1e-6))
LOAD = LayerLoad(intra_bytes=1e6, inter_bytes=2e5, local_rows=1000, remote_rows=3000)


def test_idle_link_is_the_schedule_minus_the_exchanges():
    # Degree 1 runs dispatch, GEMM, combine in sequence: the gap is the backward GEMM exactly.
    assert idle_link_s(COSTS, LOAD, 1) == pytest.approx(2.0 * 4000 * 1e-6)
    assert idle_link_s(COSTS, LOAD, 1, backward=False) == pytest.approx(4000 * 1e-6)
    for n in range(1, 6):
        busy = link_busy_s(COSTS, LOAD, n)
        assert busy == pytest.approx(2 * n * COSTS.exchange(1e6 / n, 2e5 / n))
        assert idle_link_s(COSTS, LOAD, n) == pytest.approx(max(0.0, pipeline_time(COSTS, LOAD, n, backward=True) - busy))
    # No compute: the links are never idle.
    assert idle_link_s(COSTS, LayerLoad(1e6, 0.0, 0.0, 0.0), 3) == 0.0
    with pytest.raises(ValueError, match="degree"):
        link_busy_s(COSTS, LOAD, 0)


def test_gap_slice_fits_the_gap_within_bounds():
    reduce = Linear(1e-4, 1e-9)  # 100 us startup, 1 GB/s
    total = 100 << 20
    size = gap_slice_bytes(reduce, 2.1e-3, total)  # 2 ms after the startup: 2e6 bytes
    assert size == int((2.1e-3 - 1e-4) / 1e-9)
    assert reduce(size) <= 2.1e-3 + 1e-12 < reduce(size + 1000)
    assert gap_slice_bytes(reduce, 5e-5, total) == MIN_GAP_SLICE_BYTES  # the gap is shorter than the startup
    assert gap_slice_bytes(reduce, 10.0, total) == total  # one slice: the whole reduce
    assert gap_slice_bytes(None, 1.0, total) == DEFAULT_GAP_SLICE_BYTES  # no costs: the default
    assert gap_slice_bytes(reduce, None, total) == DEFAULT_GAP_SLICE_BYTES
    assert gap_slice_bytes(reduce, 0.0, total) == DEFAULT_GAP_SLICE_BYTES  # no gap predicted
    assert gap_slice_bytes(None, None, 1000) == 1000
    assert gap_slice_bytes(Linear(0.0, 0.0), 1e-3, 5000) == 5000  # free links
    assert gap_slice_bytes(reduce, 1.0, 0) == 1


def test_rank_load_from_a_plans_traffic():
    # 4 ranks in 2 nodes of 2; traffic[d, d2]: tokens d sends d2.
    t = np.array([[5, 1, 2, 0],
                  [3, 4, 0, 1],
                  [7, 0, 6, 0],
                  [0, 0, 1, 2]])
    ld = loads_from_traffic(t, ranks_per_node=2, token_bytes=10.0)[0]
    assert ld.local_rows == 5 and ld.remote_rows == 3 + 7
    assert ld.intra_bytes == 3 * 10.0  # the busiest intra-node link: rank 0's or rank 1's (3 rows)
    # node 0's inter-node link: it sends 2 + 0 + 0 + 1, receives 7 + 0 + 0 + 0
    assert ld.inter_bytes == max(2 + 0 + 0 + 1, 7 + 0 + 0 + 0) * 10.0
    ld3 = loads_from_traffic(torch.tensor(t).numpy(), ranks_per_node=2, token_bytes=1.0)[3]
    # node 1 sends 7 + 0 + 0 + 0, receives 2 + 0 + 0 + 1
    assert (ld3.local_rows, ld3.remote_rows, ld3.intra_bytes, ld3.inter_bytes) == (2, 1, 3, 7)


def test_overlap_window_adds_the_previous_expert_compute_when_early():
    assert overlap_window(0.003, 0.002) == pytest.approx(0.005)
    assert overlap_window(0.003, 0.002, early=False) == 0.003
    assert overlap_window(0.003) == 0.003  # the first layer: gathered from the model's forward on
    with pytest.raises(ValueError, match="attention_s"):
        overlap_window(-1.0, 0.0)


def test_cost_model_feeds_the_schedule():
    hw = Hardware(flops=1e12, intra_bw=1e11, inter_bw=1e10, latency=1e-5)
    shape = ExpertShape(hidden=64, ffn=128, matrices=3, param_bytes=2)
    cm = CostModel(hw, shape, Topology(num_ranks=4, ranks_per_node=2))
    sc = cm.schedule_costs()
    assert sc.a2a_intra(1e6) == pytest.approx(1e-5 + 1e6 / 1e11)
    assert sc.a2a_inter(1e6) == pytest.approx(1e-5 + 1e6 / 1e10)
    assert sc.gemm(10) == pytest.approx(10 * shape.row_flops / 1e12)
    # An EDP group of 4: ring all-reduce 2 (n - 1) / n per byte, reduce-scatter n - 1 per byte of the piece.
    assert cm.edp_reduce_linear(4, partitioned=False).per_unit_s == pytest.approx(1.5 / 1e10)
    assert cm.edp_reduce_linear(4, partitioned=True).per_unit_s == pytest.approx(3.0 / 1e10)
    assert cm.edp_reduce_linear(4, partitioned=True).startup_s == 1e-5
    # With the overlap window a larger t: what the runtime's "auto" t is computed from.
    assert cm.overlap_degree(overlap_window(1e-3, 2e-3)) >= 3 * cm.overlap_degree(1e-3) - 1

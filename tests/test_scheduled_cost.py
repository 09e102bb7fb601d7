"""The by-time decisions' layer price (planner/scheduled.py): the runtime, the report's replay and
both simulators price a plan's layer as the exchange that runs it, through one call
(ExchangeOptions.price). Serial options give the serial price; the runtime's configuration maps
to the simulators' options; the replay rebuilds the run's price from the trace."""
import types

import numpy as np
import pytest
import torch

from ds_fssdp import Topology
from ds_fssdp.config import FSSDPConfig
from ds_fssdp.planner import CostModel, ExpertShape, Hardware
from ds_fssdp.planner.dispatch import dispatch_plan
from ds_fssdp.planner.inputs import PlannerSettings, planner_inputs
from ds_fssdp.planner.scheduled import ExchangeOptions, ScheduledCostModel
from ds_fssdp.planner.shard import homogeneous_owner
from ds_fssdp.report.replay import ReplaySettings
from ds_fssdp.runtime.stage import FSSDPStage
from ds_fssdp.sim.pipeline import SERIAL, LayerSchedule, ScheduleOptions
from ds_fssdp.sim.traces import Trace

HW = Hardware(flops=100e12, intra_bw=200e9, inter_bw=25e9, latency=10e-6)
SHAPE = ExpertShape(hidden=512, ffn=2048)
TOPO = Topology(num_ranks=8, ranks_per_node=4)


def plans(n=5, seed=3):
    gen = torch.Generator().manual_seed(seed)
    owner = homogeneous_owner(16, 8)
    for _ in range(n):
        p = torch.zeros(16, 8, dtype=torch.bool)
        p[torch.arange(16), owner] = True
        p |= torch.rand(16, 8, generator=gen) < 0.2
        yield dispatch_plan(p, torch.randint(0, 3000, (16, 8), generator=gen), TOPO)


def options(**kw):
    return ExchangeOptions(**dict(dict(top_k=2, token_bytes=float(SHAPE.token_bytes),
                                       weight_bytes=float(SHAPE.param_bytes)), **kw))


def test_serial_options_price_the_serial_layer():
    """Degree 1 without one copy is the serial four exchanges and compute (CostModel.layer_time),
    for dense and compact plans: runs with the schedule off decide as before."""
    serial = CostModel(HW, SHAPE, TOPO)
    scheduled = ScheduledCostModel(HW, SHAPE, TOPO, exchange=options(one_copy=False, degrees=(1, 1)))
    for plan in plans():
        want = serial.layer_time(plan.dense())
        assert scheduled.layer_time(plan) == pytest.approx(want, rel=1e-12)
        assert scheduled.layer_time(plan.dense()) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("schedule", [ScheduleOptions(), ScheduleOptions(dedup=False), ScheduleOptions(dedup="auto"),
                                      ScheduleOptions(pipeline_degree=3), SERIAL])
def test_the_simulators_layer_is_the_same_price(schedule):
    """The simulators price every simulated layer through their LayerSchedule; the planner's
    ScheduledCostModel with the schedule's options gives the same forward + backward, and the
    pipelined schedule is cheaper than the serial price on these plans."""
    sched = LayerSchedule(HW, SHAPE, ranks_per_node=4, top_k=2, options=schedule)
    cost = ScheduledCostModel(HW, SHAPE, TOPO, exchange=sched.exchange)
    serial = CostModel(HW, SHAPE, TOPO)
    for plan in plans():
        lt = sched.layer(plan.dense().sum(0).double().numpy()[None])
        got = cost.layer_time(plan)
        assert got == pytest.approx(float(lt.forward_B[0] + lt.backward_B[0]), rel=1e-12)
        if schedule is not SERIAL:
            assert got < serial.layer_time(plan)


def _stage(side_ratio=0.0, **fssdp):
    cfg = FSSDPConfig(**fssdp)
    inputs = planner_inputs(PlannerSettings.of(cfg, budget=0), num_experts_L=[16], topology=TOPO)  # its two hops
    return types.SimpleNamespace(config=cfg, pipeline_degree=cfg.pipeline_degrees(), inputs=inputs,
                                 layers=[types.SimpleNamespace(k=2)], side_ratio=side_ratio)


@pytest.mark.parametrize("fssdp,schedule,side", [
    ({}, ScheduleOptions(), 0.0),
    ({}, ScheduleOptions(), 1.5),
    ({"one_copy_per_destination": False}, ScheduleOptions(dedup=False), 0.0),
    ({"pipeline_degree": 3}, ScheduleOptions(pipeline_degree=3), 0.0),
])
def test_the_runtime_prices_as_the_simulators(fssdp, schedule, side):
    """The runtime's options from its configuration (FSSDPStage.exchange_options) are the
    simulators' from the matching schedule options: the same plans get the same price (with
    the shared experts beside the exchange too)."""
    runtime = FSSDPStage.exchange_options(_stage(side, **fssdp), SHAPE)
    assert runtime == LayerSchedule(HW, SHAPE, ranks_per_node=4, top_k=2, options=schedule,
                                    side_ratio=side).exchange
    rt = FSSDPStage.exchange_options(_stage(pipeline_degree={"forward": 2, "backward": 5},
                                            topology_aware=False), SHAPE)
    assert rt.degrees == (2, 5) and rt.two_hops is False


def test_the_replay_rebuilds_the_runs_price():
    """A trace that records the exchange replays with its ScheduledCostModel; one from before
    the record, with the serial CostModel (what its run priced with)."""
    meta = {"hardware": {"flops": HW.flops, "intra_bw": HW.intra_bw, "inter_bw": HW.inter_bw, "latency": HW.latency},
            "expert_shape": {"hidden": SHAPE.hidden, "ffn": SHAPE.ffn}, "top_k": 2, "ranks_per_node": 4}
    trace = Trace(np.zeros((1, 1, 16, 8), dtype=np.int32), dict(meta))
    old = ReplaySettings.from_trace(trace).cost_model(TOPO)
    assert type(old) is CostModel
    trace = Trace(np.zeros((1, 1, 16, 8), dtype=np.int32),
                  dict(meta, one_copy_per_destination="auto", pipeline_degree=[2, 4], topology_aware=True))
    new = ReplaySettings.from_trace(trace).cost_model(TOPO)
    assert isinstance(new, ScheduledCostModel)
    assert new.exchange == options(one_copy="auto", degrees=(2, 4))
    for plan in plans(2):
        assert new.layer_time(plan) == ScheduledCostModel(HW, SHAPE, TOPO, exchange=new.exchange).layer_time(plan)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("one_copy", [True, "auto", False])
def test_the_runtimes_exchange_decision_is_what_its_price_assumes(top_k, one_copy):
    """exchange_decision (what the runtime runs and the replay retakes) and ExchangeOptions.price
    (what the by-time decisions and the simulators price) take one copy per destination by one
    rule: never at top-1 (a token has one row there), as configured or chosen above it."""
    from ds_fssdp.planner.cost import schedule_costs
    from ds_fssdp.planner.onecopy import choose_exchange
    from ds_fssdp.planner.scheduled import exchange_decision, one_copy_at
    costs = schedule_costs(HW, SHAPE)
    for plan in plans(3):
        traffic = plan.traffic_DD().to(torch.float64).numpy()
        common = dict(ranks_per_node=4, token_bytes=float(SHAPE.token_bytes), top_k=top_k,
                      weight_bytes=float(SHAPE.param_bytes))
        for degree in ("auto", (2, 3)):
            degrees, taken = exchange_decision(costs, traffic, pipeline_degree=degree, one_copy=one_copy,
                                               two_hops=True, **common)
            if top_k == 1:
                assert taken is False
            elif one_copy != "auto":
                assert taken is one_copy
            want = choose_exchange(costs, traffic, one_copy=one_copy_at(one_copy, top_k),
                                   degrees=None if degree == "auto" else degree, relay=True, **common)
            assert (degrees, taken) == want
            priced = ExchangeOptions(top_k=top_k, token_bytes=common["token_bytes"],
                                     weight_bytes=common["weight_bytes"], one_copy=one_copy,
                                     degrees=None if degree == "auto" else degree, two_hops=True)
            assert priced.price(costs, traffic, ranks_per_node=4).degrees == tuple(degrees)
        assert exchange_decision(None, traffic, pipeline_degree="auto", one_copy=one_copy, two_hops=True,
                                 **common) == ((1, 1), top_k > 1 and one_copy is not False)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match=r"one_copy \('yes'\)"):
        options(one_copy="yes")
    with pytest.raises(ValueError, match=r"degrees \(\(0, 2\)\)"):
        options(degrees=(0, 2))

"""Decision equality: the runtime and the replay drive the same policy object, so on the same
recorded trace they make the same decisions, step by step: owners (re-shards, SmartMoE's
permutations), pre-gating placements, the final placements after calibration or shadowing,
calibration's t and acceptance, the clock (t, latency budget), the dispatch plans (digest, rows
per rank, rank-to-rank traffic), the exchange (pipeline degrees and one copy per destination,
retaken from the recorded schedule costs and row sizes). Every runtime policy, the RM variant, the placements and dispatch
modes, on 4 ranks in 2 logical nodes, in one spawn. This is the guard against the copies of the
per-step chain drifting apart again."""
import os
import tempfile

import numpy as np
import pytest
import torch

from distributed import spawn
from training import ds_config, train_worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD, STEPS = 4, 6
HW = {"flops": 1e6, "intra_bw": 1e9, "inter_bw": 1e7}  # slow compute: replicas and shadows pay
DIR = tempfile.mkdtemp(prefix="fssdp-decisions-")


def _run(policy="fssdp", **fssdp):
    return ds_config(world=WORLD, zero=0, gas=1, clip=0.0, policy=policy,
                     fssdp=dict({"ranks_per_node": 2, "trace_path": os.path.join(DIR, f"{len(RUNS)}.npz")}, **fssdp))


RUNS = {}
for name, kwargs in {
    # t and calibration's budget from the measured, agreed windows: the recorded clock matters.
    "fssdp-calibrated-auto": dict(calibration=True, overlap_degree="auto", hardware=HW, reshard_interval=2),
    # a slow node link: the window hides no expert, and the search by time takes some (the compute is slower)
    "fssdp-auto-by-time": dict(overlap_degree="auto", hardware=dict(HW, inter_bw=1e5), calibration=True),
    # no hardware: t searched on the schedule's costs fitted at initialize, recorded per decision
    "fssdp-auto-fitted": dict(overlap_degree="auto"),
    "fssdp-rm-paper": dict(rematerialize=True, placement="paper", dispatch="paper", reshard_interval=3),
    "fssdp-time-calibrated": dict(dispatch="balanced-time", hardware=HW, calibration=True,
                                  calibration_latency_budget=1e-3),
    "ep": dict(policy="ep"),
    "uniform": dict(policy="uniform"),
    "fastermoe": dict(policy="fastermoe", hardware=HW),
    # Algorithm 2 and SmartMoE's permutation fire on the same steps (2 and 4).
    "smartmoe-reshard": dict(policy="smartmoe", smartmoe_interval=2, reshard_interval=2),
}.items():
    RUNS[name] = _run(**kwargs)

EXPERT_ROW_BYTES = 2 * 16 * 24 * 4  # a 16x24 gelu expert in fp32


@pytest.fixture(scope="module")
def runs():
    results = spawn(WORLD, train_worker, RUNS, STEPS)
    from ds_fssdp.report.check import compare
    from ds_fssdp.report.replay import replay
    from ds_fssdp.sim.traces import load_trace
    out = {}
    for name, cfg in RUNS.items():
        trace = load_trace(cfg["fssdp"]["trace_path"])
        out[name] = dict(trace=trace, replay=replay(trace), results=[r[name] for r in results])
        out[name]["diffs"] = compare(trace, out[name]["replay"])
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_runtime_decisions_equal_the_replay(runs, name):
    r = runs[name]
    trace, rep = r["trace"], r["replay"]
    assert trace.tokens_SLED.shape[0] == STEPS
    assert "decision_plan_digest" in trace.arrays
    assert r["diffs"] == [], r["diffs"]
    assert rep.decisions["decision_owner"].shape == trace.arrays["decision_owner"].shape == (STEPS, 2, 8)


def test_the_runs_made_decisions_worth_comparing(runs):
    """Each run exercised what it is there for (an equality of empty decisions proves nothing)."""
    held = {n: r["trace"].arrays["decision_held"] for n, r in runs.items()}
    placed = {n: r["trace"].arrays["decision_placed"] for n, r in runs.items()}
    E = held["ep"].shape[2]
    assert held["ep"].sum((2, 3)).max() == E and held["uniform"].sum((2, 3)).max() == E
    for n in ("fssdp-calibrated-auto", "fssdp-auto-by-time", "fssdp-rm-paper", "fssdp-time-calibrated"):
        assert placed[n].sum((2, 3)).max() > E, n  # pre-gating replicas
    assert (held["fastermoe"] & ~placed["fastermoe"]).any()  # shadows
    cal = runs["fssdp-calibrated-auto"]["trace"].arrays
    assert (cal["decision_calibration_t"] >= 0).all()  # calibration ran on every layer and step
    assert np.isfinite(cal["decision_latency_budget"][1:]).all()  # the agreed window, after step 1
    assert len(np.unique(cal["decision_t"])) >= 1 and (cal["decision_t"] >= 0).all()
    # "auto": t searched by the modelled time from the agreed window (planner/overlap.py), never below its t
    assert np.isnan(runs["ep"]["trace"].arrays["decision_window_s"]).all()
    for n in ("fssdp-calibrated-auto", "fssdp-auto-by-time"):
        rec = runs[n]["trace"].arrays
        assert np.isfinite(rec["decision_window_s"][1:]).all()
        # the window's attention part: what the replica reduce's window is priced from
        assert (np.isfinite(rec["decision_attention_s"][1:]) & (rec["decision_attention_s"][1:] > 0)).all()
        assert (rec["decision_attention_s"][1:] <= rec["decision_window_s"][1:]).all()
        assert (rec["decision_overlap_t"] >= rec["decision_t"]).all()
    fitted = runs["fssdp-auto-fitted"]["trace"].arrays["decision_schedule_costs"]
    assert np.isfinite(fitted).all() and (fitted[..., 7] == 0).all()  # fitted on CPU ranks: not concurrent
    for r in runs["fssdp-auto-fitted"]["results"]:  # the by-time price uses the fitted costs
        assert r["price_costs"] == r["schedule_costs"] and r["price_costs"]["concurrent"] is False
    slow = runs["fssdp-auto-by-time"]["trace"].arrays
    assert (slow["decision_overlap_t"] > slow["decision_t"]).any(), (slow["decision_t"], slow["decision_overlap_t"])
    for n in ("fssdp-calibrated-auto", "fssdp-rm-paper", "smartmoe-reshard"):
        owners = runs[n]["trace"].arrays["decision_owner"]
        assert (owners != owners[0]).any(), f"{n}: no re-shard moved an expert"
    assert any(len(step) == 2 for step in runs["smartmoe-reshard"]["replay"].reshards)


def test_migration_bytes_count_both_reshards_of_a_step(runs):
    """A step where Algorithm 2 and SmartMoE's permutation both fire reports the bytes of both:
    each rank sent the rows of every expert it gave away in either (master + SGD momentum)."""
    r = runs["smartmoe-reshard"]
    both = 0
    for step in range(STEPS - 1):  # the migrations after step ``step`` precede iteration step + 1
        reshards = r["replay"].reshards[step + 1]
        both += len(reshards) == 2
        for rank, res in enumerate(r["results"]):
            sent = sum(int((x.copies_M4[:, 2] == rank).sum()) for x in reshards)
            assert res["migrated"][step] == sent * 2 * EXPERT_ROW_BYTES, (step, rank)
    assert both >= 1


@pytest.mark.parametrize("name,sim_name", [("fssdp-rm-paper", "fssdp-rm"), ("ep", "ep"), ("uniform", "uniform")])
def test_simulator_decisions_equal_the_runtime(runs, name, sim_name):
    """Both simulators (sim/simulate.py; sim/cluster.py for the planned policy) on the runtime's
    recorded trace make the runtime's decisions step by step (owners after re-shards, pre-gating
    placements, final placements) wherever their clock is the runtime's: a fixed t and no
    calibration (the modelled windows of the other runs are the simulators' own clock; the replay
    checks those against the recorded clock)."""
    from ds_fssdp.planner.cost import ExpertShape, Hardware
    from ds_fssdp.sim.pipeline import ScheduleOptions
    from ds_fssdp.sim.setup import Setup
    from ds_fssdp.sim.simulate import simulate_policy
    from ds_fssdp.topology import Topology

    trace = runs[name]["trace"]
    m, (S, L, E, D) = trace.meta, trace.tokens_SLED.shape
    assert m["overlap_degree"] != "auto" and not m["calibration"]
    setup = Setup(topology=Topology(num_ranks=D, ranks_per_node=m["ranks_per_node"]),
                  hw=Hardware(flops=1e12, intra_bw=1e9, inter_bw=1e8),
                  shape=ExpertShape(hidden=16, ffn=24, matrices=2, param_bytes=4), num_layers=L, num_experts=E,
                  tokens_per_gpu=64, attention_flops_per_token=1e3, dense_params=1000,
                  overlap_degree=m["overlap_degree"], budget=m["materialization_budget"],
                  budget_rm=m["materialization_budget"], flexmoe_slots=0, reshard_interval=m["reshard_interval"],
                  calibration=False, load_window=m["load_window"])
    simulated = {"simulate": []}
    fixed_t = ScheduleOptions(idle_link=False)  # t is the config's, not the modelled idle-link window's
    simulate_policy(sim_name, setup, trace.tokens_SLED, placement=m["placement"], dispatch=m["dispatch"],
                    dispatch_slack=m["dispatch_slack"], decisions=simulated["simulate"], schedule=fixed_t)
    if sim_name.startswith("fssdp"):  # the cluster simulator records the planned policies' decisions
        from ds_fssdp.sim.cluster import PolicyRun
        assert m["dispatch"] == "paper" and m["placement"] == "paper"  # the cluster simulator's defaults
        simulated["cluster"] = []
        run = PolicyRun(sim_name, setup, overlap_degree=m["overlap_degree"], decisions=simulated["cluster"])
        for step in range(S):
            run.step(step, trace.tokens_SLED[step])
    for simulator, decisions in simulated.items():
        for key, i in (("decision_owner", 0), ("decision_placed", 1), ("decision_held", 2)):
            got = np.stack([[layer[i].numpy() for layer in step] for step in decisions])
            np.testing.assert_array_equal(got, trace.arrays[key], err_msg=f"{simulator}: {key}")


def test_the_replay_prices_with_the_recorded_costs(runs):
    """The by-time decisions price with the schedule's costs each decision recorded (fitted, or
    the hardware's): the replay of a record whose GEMMs are far slower, so that balance is worth
    more replicas, searches to a larger t than the run took."""
    from ds_fssdp.report.replay import replay
    from ds_fssdp.sim.traces import Trace
    trace = runs["fssdp-auto-by-time"]["trace"]
    costs = trace.arrays["decision_schedule_costs"].copy()
    assert np.isfinite(costs).all()
    costs[..., 5] *= 1e4  # the GEMM's seconds per row
    slow = replay(Trace(trace.tokens_SLED, trace.meta, dict(trace.arrays, decision_schedule_costs=costs)))
    want = trace.arrays["decision_overlap_t"]
    assert (slow.decisions["decision_overlap_t"] > want).any(), (want, slow.decisions["decision_overlap_t"])


def test_the_replay_retakes_the_exchange_with_the_recorded_work_beside_it(runs, monkeypatch):
    """Each decision records the work beside the exchange it priced (the block's shared experts,
    moe/side.py; none in these runs); the replay hands the recorded value to the one exchange
    decision, and records it back."""
    import ds_fssdp.report.replay as replay_mod
    from ds_fssdp.sim.traces import Trace
    trace = runs["fssdp-auto-by-time"]["trace"]
    side = trace.arrays["decision_side_ratio"]
    assert side.shape == trace.arrays["decision_t"].shape and (side == 0).all()
    seen = []
    decide = replay_mod.exchange_decision

    def spy(*args, **kwargs):
        seen.append(kwargs["side_ratio"])
        return decide(*args, **kwargs)
    monkeypatch.setattr(replay_mod, "exchange_decision", spy)
    marked = np.arange(side.size, dtype=np.float64).reshape(side.shape) / 7.0
    got = replay_mod.replay(Trace(trace.tokens_SLED, trace.meta, dict(trace.arrays, decision_side_ratio=marked)))
    assert seen == marked.ravel().tolist()
    assert "decision_side_ratio" not in got.decisions  # an input: read, never compared

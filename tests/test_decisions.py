"""Decision equality: the replay derives every decision from the trace's inputs alone (counts, agreed
windows, optimizer steps, recorded costs) through the functions the runtime calls, and makes the
runtime's decisions, step by step: owners (re-shards, SmartMoE's
permutations), pre-gating placements, the final placements after calibration or shadowing,
calibration's t and acceptance, the clock (t, latency budget), the dispatch plans (digest, rows
per rank, rank-to-rank traffic), the exchange (pipeline degrees and one copy per destination,
retaken from the recorded schedule costs and row sizes). Every runtime policy, the RM variant, the
placements and dispatch modes, on 4 ranks in 2 logical nodes, in one spawn, and gradient
accumulation 2 under ZeRO 1 with re-shards, calibration and "auto" t. The simulator in its real
mode (t from its modelled windows, calibration, SmartMoE's or Algorithm 2's re-shards; the paper's
report, and groups at ZeRO 1; gradient accumulation 2 on the GAS 2 run's counts) makes the
decisions derived from its own inputs. Negative controls
perturb one function on one side (the replay's window-to-t rule, relabelling, a price; the
simulator's clock rule or re-shards) or one recorded decision, and the check must name a
difference. This is the guard against the copies of the per-step chain drifting apart again."""
import dataclasses
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


def _run(policy="fssdp", zero=0, gas=1, **fssdp):
    return ds_config(world=WORLD, zero=zero, gas=gas, clip=0.0, policy=policy,
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
    # two micro-steps per optimizer step (trace rows): the re-shards follow the optimizer steps
    "fssdp-gas2-zero1": dict(zero=1, gas=2, calibration=True, overlap_degree="auto", hardware=HW, reshard_interval=2),
    # 2 FSSDP groups of 2: the re-shards plan from the loads summed over both (the trace holds group 0's counts)
    "fssdp-groups2-gas2": dict(zero=1, gas=2, group_size=2, calibration=True, overlap_degree="auto", hardware=HW,
                               reshard_interval=2),
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
    rows = STEPS * RUNS[name]["gradient_accumulation_steps"]
    assert trace.tokens_SLED.shape[0] == rows
    assert "decision_plan_digest" in trace.arrays
    assert r["diffs"] == [], r["diffs"]
    assert rep.decisions["decision_owner"].shape == trace.arrays["decision_owner"].shape == (rows, 2, 8)
    # derived, not read back: the clock, the placements, the dispatch (the inputs are not compared)
    assert {"decision_t", "decision_latency_budget", "decision_held", "decision_plan_digest"} <= set(rep.decisions)
    assert not {"decision_schedule_costs", "decision_row_bytes", "decision_side_ratio"} & set(rep.decisions)


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
    """The simulator (sim/cluster.py; the paper's report: one group, the setup's t) on the runtime's
    recorded trace makes the runtime's decisions step by step (owners after re-shards, pre-gating
    placements, final placements) wherever their clock is the runtime's: a fixed t and no
    calibration (the modelled windows of the other runs are the simulators' own clock; the replay
    checks those against the recorded clock)."""
    from ds_fssdp.planner.cost import ExpertShape, Hardware
    from ds_fssdp.sim.pipeline import ScheduleOptions
    from ds_fssdp.sim.setup import Setup
    from ds_fssdp.sim.cluster import PolicyRun, run_cluster
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
    simulated = {"paper": []}
    fixed_t = ScheduleOptions(idle_link=False)  # t is the config's, not the modelled idle-link window's
    runs = [PolicyRun(sim_name, setup, overlap_degree=setup.overlap_degree, placement=m["placement"],
                      dispatch=m["dispatch"], dispatch_slack=m["dispatch_slack"], decisions=simulated["paper"],
                      schedule=fixed_t)]
    if sim_name.startswith("fssdp"):  # the cluster defaults: the idle-link schedule with the t given
        assert m["dispatch"] == "paper" and m["placement"] == "paper"
        simulated["cluster"] = []
        runs.append(PolicyRun(sim_name, setup, overlap_degree=m["overlap_degree"], decisions=simulated["cluster"]))
    run_cluster(runs, trace.tokens_SLED, bound=False)
    for mode, decisions in simulated.items():
        assert len(decisions) == S
        for key, i in (("decision_owner", 0), ("decision_placed", 1), ("decision_held", 2)):
            got = np.stack([[layer[i].numpy() for layer in step] for step in decisions])
            np.testing.assert_array_equal(got, trace.arrays[key], err_msg=f"{mode}: {key}")


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


def _check(trace):
    from ds_fssdp.report.check import check
    return check(trace)


def test_gas2_reshards_follow_the_optimizer_steps(runs):
    """Two micro-steps (trace rows) per optimizer step: the runtime re-shards after optimizer steps
    2 and 4, i.e. before rows 4 and 8, and the replay derives it there; replaying each row as its
    own step (what the trace's rows alone say) re-shards before row 2 and differs."""
    from ds_fssdp.report.check import compare
    from ds_fssdp.report.replay import replay
    from ds_fssdp.sim.traces import Trace
    r = runs["fssdp-gas2-zero1"]
    trace, rep = r["trace"], r["replay"]
    np.testing.assert_array_equal(trace.arrays["optimizer_step"], np.repeat(np.arange(STEPS), 2))
    assert rep.reshard_steps == [2, 4]
    assert [row for row, done in enumerate(rep.reshards) if done] == [4, 8]
    owners = trace.arrays["decision_owner"]
    assert (owners[4] != owners[3]).any() and (owners[:4] == owners[0]).all()
    assert np.isfinite(trace.arrays["agreed_window_s"][2:]).all()
    assert (trace.arrays["decision_calibration_t"] >= 0).all()
    rows_as_steps = {k: v for k, v in trace.arrays.items() if k != "optimizer_step"}
    assert compare(trace, replay(Trace(trace.tokens_SLED, trace.meta, rows_as_steps))) != []


def test_groups_reshard_from_the_recorded_world_loads(runs, tmp_path, capsys):
    """Two FSSDP groups of 2: every group re-shards from the loads summed over both (each group's
    counts differ), which the runtime records per row (``reshard_world_load``); the replay derives
    the re-shards from them, and ``--check`` passes. Every rank ends with the same owners. Negative
    controls: the world's loads perturbed at the first re-shard (experts reversed), or one recorded
    owner flipped, fail naming the row after optimizer step 2."""
    from ds_fssdp.planner import LoadPredictor
    from ds_fssdp.report.__main__ import main
    from ds_fssdp.sim.traces import Trace, save_trace
    r = runs["fssdp-groups2-gas2"]
    trace, rep = r["trace"], r["replay"]
    assert trace.meta["fssdp_groups"] == 2 and trace.tokens_SLED.shape[3] == 2 and rep.reshard_steps == [2, 4]
    owners, world = trace.arrays["decision_owner"], trace.arrays["reshard_world_load"]
    assert (owners[4] != owners[3]).any() and (owners[:4] == owners[0]).all()
    for res in r["results"][1:]:
        assert all(torch.equal(a, b) for a, b in zip(res["owners"], r["results"][0]["owners"]))
    assert np.isnan(world[:2]).all() and np.isfinite(world[2:]).all()
    group0 = LoadPredictor([8, 8], window=trace.meta["load_window"])
    for row in range(4):
        for l in range(2):
            group0.observe(l, torch.from_numpy(trace.tokens_SLED[row, l].astype(np.int64)))
    own = group0.predict_all().numpy()  # group 0's own prediction at the first re-shard: the other's adds
    assert (world[4] >= own).all() and (world[4] > own).any()
    cases = {"run": trace.arrays,
             "loads": dict(trace.arrays, reshard_world_load=np.concatenate([world[:4], world[4:, :, ::-1]])),
             "owner": dict(trace.arrays, decision_owner=np.concatenate([owners[:4], (owners[4:] + 1) % 2]))}
    codes = {}
    for name, arrays in cases.items():
        (tmp_path / name).mkdir()
        save_trace(str(tmp_path / name / "trace.npz"), Trace(trace.tokens_SLED, trace.meta, arrays))
        codes[name] = main([str(tmp_path / name), "--check"]), capsys.readouterr().out
    assert codes["run"][0] == 0 and "re-shards after optimizer steps [2, 4]" in codes["run"][1], codes["run"]
    for name in ("loads", "owner"):
        assert codes[name][0] == 1 and "decision differs: iteration 4, layer 0, array decision_owner" in codes[name][1]


# Negative controls: each perturbs one function on the replay's side only (the runtime ran in its
# own processes), and the check must then name a difference.

def test_control_perturbed_window_to_t_rule(runs, monkeypatch):
    from ds_fssdp.planner.inputs import ClockRule
    rule = ClockRule.clock

    def off_by_one(self, window_s, attention_s=None, *, num_experts=None):
        clock = rule(self, window_s, attention_s, num_experts=num_experts)
        if self.overlap_degree == "auto" and window_s is not None:
            return dataclasses.replace(clock, overlap_degree=clock.overlap_degree - 1)
        return clock
    trace = runs["fssdp-gas2-zero1"]["trace"]
    assert _check(trace).first is None
    monkeypatch.setattr(ClockRule, "clock", off_by_one)
    assert _check(trace).first == (2, 0, "decision_t")  # the first row with an agreed window


def test_control_different_relabelling(runs, monkeypatch):
    """Algorithm 2's owners relabelled otherwise (each node's two ranks swapped): the first
    re-shard's owners differ, before row 4 (after optimizer step 2)."""
    import ds_fssdp.planner.baselines.fssdp as fssdp_mod
    relabel = fssdp_mod.relabel_owner
    monkeypatch.setattr(fssdp_mod, "relabel_owner", lambda *a, **kw: relabel(*a, **kw) ^ 1)
    first = _check(runs["fssdp-gas2-zero1"]["trace"]).first
    assert first is not None and first[0] == 4 and first[2] == "decision_owner", first


def test_control_price_off_by_ten_percent(runs, monkeypatch):
    """The binding link's bandwidth (every gather's price: calibration's extra experts within its
    fixed latency budget, on the configured hardware) 10% low changes a calibration."""
    from ds_fssdp.planner.cost import CostModel
    trace = runs["fssdp-time-calibrated"]["trace"]
    assert _check(trace).first is None
    bandwidth = CostModel.binding_bandwidth
    monkeypatch.setattr(CostModel, "binding_bandwidth", property(lambda self: 0.9 * bandwidth.fget(self)))
    assert _check(trace).first is not None


@pytest.mark.parametrize("key,index", [("decision_t", (7, 1)), ("decision_placed", (9, 0, 3, 1)),
                                       ("decision_traffic", (11, 1, 0, 2)), ("decision_owner", (4, 1, 5)),
                                       ("decision_calibration_accepted", (5, 0))])
def test_control_tampered_record(runs, key, index, tmp_path, capsys):
    """One recorded decision flipped in a copy of the trace: ``--check`` exits 1 naming it (the
    re-shard's owner: the first row after optimizer step 2), and 0 on the trace as recorded."""
    from ds_fssdp.report.__main__ import main
    from ds_fssdp.sim.traces import Trace, save_trace
    trace = runs["fssdp-gas2-zero1"]["trace"]
    (tmp_path / "run").mkdir()
    (tmp_path / "bad").mkdir()
    save_trace(str(tmp_path / "run" / "trace.npz"), trace)
    assert main([str(tmp_path / "run"), "--check"]) == 0
    assert f"checked {STEPS * 2 * 2 * 15} decisions" in capsys.readouterr().out
    flipped = trace.arrays[key].copy()
    flipped[index] = ~flipped[index] if flipped.dtype == bool else (flipped[index] + 1) % 4
    save_trace(str(tmp_path / "bad" / "trace.npz"), Trace(trace.tokens_SLED, trace.meta,
                                                           dict(trace.arrays, **{key: flipped})))
    assert main([str(tmp_path / "bad"), "--check"]) == 1
    assert f"decision differs: iteration {index[0]}, layer {index[1]}, array {key}" in capsys.readouterr().out


def test_check_refuses_what_it_cannot_derive(runs, tmp_path, capsys):
    """Refused by name (exit 2), never passed: a trace without the inputs, re-shards on loads of
    several FSSDP groups, a trace that starts mid-run (resumed), and the override flags."""
    from ds_fssdp.report.__main__ import main
    from ds_fssdp.sim.traces import Trace, save_trace
    trace = runs["fssdp-gas2-zero1"]["trace"]
    cases = {"no-steps": Trace(trace.tokens_SLED, trace.meta,
                               {k: v for k, v in trace.arrays.items() if k != "optimizer_step"}),
             "groups": Trace(trace.tokens_SLED, dict(trace.meta, fssdp_groups=2), trace.arrays),
             "resumed": Trace(trace.tokens_SLED, trace.meta,
                              dict(trace.arrays, optimizer_step=trace.arrays["optimizer_step"] + 3))}
    for name, t in cases.items():
        (tmp_path / name).mkdir()
        save_trace(str(tmp_path / name / "trace.npz"), t)
    assert main([str(tmp_path / "no-steps"), "--check"]) == 2
    assert "optimizer_step" in capsys.readouterr().err
    assert main([str(tmp_path / "groups"), "--check"]) == 2
    assert "2 FSSDP groups" in capsys.readouterr().err
    assert main([str(tmp_path / "resumed"), "--check"]) == 2
    assert "after optimizer step 3" in capsys.readouterr().err
    assert main([str(tmp_path / "groups"), "--check", "--budget", "3"]) == 2
    assert "--budget" in capsys.readouterr().err


def _sim_setup(trace, **overrides):
    from ds_fssdp.planner.cost import ExpertShape, Hardware
    from ds_fssdp.sim.setup import Setup
    from ds_fssdp.topology import Topology
    m, (S, L, E, D) = trace.meta, trace.tokens_SLED.shape
    return Setup(**dict(dict(topology=Topology(num_ranks=D, ranks_per_node=m["ranks_per_node"]),
                             hw=Hardware(flops=1e9, intra_bw=1e9, inter_bw=1.5e8),
                             shape=ExpertShape(hidden=16, ffn=24, matrices=2, param_bytes=4), num_layers=L,
                             num_experts=E, tokens_per_gpu=64, attention_flops_per_token=1e3, dense_params=1000,
                             overlap_degree=2, budget=2, budget_rm=2, flexmoe_slots=0, reshard_interval=2,
                             smartmoe_interval=2, calibration=True, load_window=2), **overrides))


def _replay_of_simulated(trace, captured, windows_SL, attention_s, monkeypatch):
    """The replay's decisions from the simulator's inputs: its settings, its windows (the clock's
    inputs), its prices (the cost object it decided with), the trace's counts and the runtime's
    record of its optimizer steps (rows per step: its GAS)."""
    from ds_fssdp.report.replay import ReplaySettings, replay
    from ds_fssdp.sim.traces import Trace
    settings, cost = captured["settings"], captured["cost"]
    s = ReplaySettings(policy=settings.policy, budget=settings.budget, overlap_degree=settings.overlap_degree,
                       window=trace.meta["load_window"], ranks_per_node=trace.meta["ranks_per_node"],
                       placement=settings.placement, dispatch=settings.dispatch,
                       dispatch_slack=settings.dispatch_slack, reshard_interval=settings.reshard_interval,
                       calibration=settings.calibration, calibration_latency_budget=settings.calibration_latency_budget,
                       smartmoe_interval=settings.smartmoe_interval, rematerialize=settings.rematerialize)
    monkeypatch.setattr(ReplaySettings, "cost_model", lambda self, topology, costs=None, two_hops=None: cost)
    S, L = trace.tokens_SLED.shape[:2]
    inputs = {"optimizer_step": trace.arrays["optimizer_step"], "agreed_window_s": windows_SL,
              "agreed_attention_s": np.full((S, L), attention_s)}
    return replay(Trace(trace.tokens_SLED, trace.meta, inputs), s)


def _simulated_and_derived(trace, monkeypatch, *, engine, policy, zero, gas=1, perturb=None):
    """Run a simulator in its real mode at ``gas`` micro-steps per optimizer step on ``trace``'s counts
    (``perturb``: "t", its clock rule from half its window, "no-reshard", or "micro-steps": every row
    its own optimizer step, in the simulator only) and the replay on the simulator's inputs and the
    runtime's optimizer steps (``gas``: the run's); returns the simulator's (owner, placed, held) arrays, the replay, the settings and the
    windows."""
    import ds_fssdp.planner.layer as layer_mod
    from ds_fssdp.planner.inputs import ClockRule
    import ds_fssdp.sim.cluster as sim_mod
    S, L = trace.tokens_SLED.shape[:2]
    setup = _sim_setup(trace, zero_stage=zero, gas=1 if perturb == "micro-steps" else gas)
    captured, windows, calls = {}, np.full((S, L), np.nan), []
    factory, pre = sim_mod.planner_inputs, layer_mod.LayerPlanner.pre_gating_t

    class Recording(ClockRule):  # the window the simulator hands its clock rule (under "t": half of it used)
        def clock(self, window_s=None, attention_s=None, **kw):
            captured["window"] = window_s
            if perturb == "t" and window_s is not None:
                window_s, attention_s = window_s / 2, None if attention_s is None else attention_s / 2
            return ClockRule.clock(self, window_s, attention_s, **kw)

    def spy_inputs(settings, **kw):
        captured.update(settings=settings, cost=kw["cost"])
        inputs = factory(settings, **kw)
        inputs = dataclasses.replace(inputs, clock_rule=Recording(**dataclasses.asdict(inputs.clock_rule)))
        if perturb == "no-reshard":
            inputs = dataclasses.replace(inputs, migrators=[])
        return inputs

    def spy_pre(self, owner_E, clock=None):  # the layer's clock is the rule's last call
        calls.append((self.layer, captured["window"] if clock.window_s is not None else None))
        return pre(self, owner_E, clock)
    monkeypatch.setattr(sim_mod, "planner_inputs", spy_inputs)
    monkeypatch.setattr(layer_mod.LayerPlanner, "pre_gating_t", spy_pre)
    decisions = []
    # "paper": the paper's report (the setup's t where not from the window); "cluster": t derived for the group
    paper = dict(overlap_degree=setup.overlap_degree, fixed_t=False) if engine == "paper" else {}
    run = sim_mod.PolicyRun(policy, setup, decisions=decisions, **paper)
    for step in range(S):
        run.step(step, trace.tokens_SLED[step])
    monkeypatch.setattr(layer_mod.LayerPlanner, "pre_gating_t", pre)
    assert len(calls) == S * L  # one group: one pre-gating per layer and step
    for i, (l, w) in enumerate(calls):
        windows[i // L, l] = np.nan if w is None else w
    rep = _replay_of_simulated(trace, captured, windows, setup.attention_fwd_s, monkeypatch)
    got = {key: np.stack([[layer[i].numpy() for layer in step] for step in decisions])
           for key, i in (("decision_owner", 0), ("decision_placed", 1), ("decision_held", 2))}
    return got, rep, captured["settings"], windows


REAL_MODE = [("paper", "smartmoe", 0, 1), ("paper", "fssdp", 0, 1), ("cluster", "fssdp", 1, 1),
             ("paper", "fssdp", 0, 2), ("cluster", "fssdp", 1, 2)]
GAS_TRACE = {1: "smartmoe-reshard", 2: "fssdp-gas2-zero1"}  # the runtime's counts, at its GAS


@pytest.mark.parametrize("engine,policy,zero,gas", REAL_MODE)
def test_simulators_in_their_real_mode_decide_as_derived(runs, monkeypatch, engine, policy, zero, gas):
    """The simulator in its real mode (FSSDP's t from each layer's modelled window, searched by
    time; calibration on; SmartMoE's permutation (its fixed t, as published) or Algorithm 2
    re-sharding every 2 optimizer steps; the paper's report, or at ZeRO 1 with t derived; gradient accumulation 2 on
    the counts of the runtime's GAS 2 run) on the runtime's recorded counts make the decisions the
    replay derives from the simulator's own inputs (its settings, windows and prices, the optimizer
    steps at the simulator's GAS) through the runtime's functions: owners, pre-gating and final
    placements, micro-step by micro-step."""
    trace = runs[GAS_TRACE[gas]]["trace"]
    got, rep, settings, windows = _simulated_and_derived(trace, monkeypatch, engine=engine, policy=policy, zero=zero,
                                                         gas=gas)
    # SmartMoE runs as published: its fixed t (the simulators price its exchange without the idle link)
    assert settings.overlap_degree == ("auto" if policy == "fssdp" else 2) and settings.calibration
    assert np.isfinite(windows).all() == (policy == "fssdp")
    for key, value in got.items():
        np.testing.assert_array_equal(value, rep.decisions[key], err_msg=f"{engine} {policy}: {key}")
    owners = rep.decisions["decision_owner"]
    assert (owners != owners[0]).any(), "no re-shard moved an expert"
    moved = [r for r in range(1, len(owners)) if (owners[r] != owners[r - 1]).any()]
    assert all(r % (2 * gas) == 0 for r in moved), moved  # after every 2nd optimizer step, never between micro-steps
    if policy == "fssdp":  # calibration is FSSDP's
        assert (rep.decisions["decision_calibration_t"] >= 0).all()
        assert (rep.decisions["decision_t"] < trace.tokens_SLED.shape[2]).any()  # windows that bind t


@pytest.mark.parametrize("engine,policy,zero,gas,perturb", [
    ("paper", "fssdp", 0, 1, "t"), ("cluster", "fssdp", 1, 1, "t"), ("paper", "smartmoe", 0, 1, "no-reshard"),
    ("cluster", "fssdp", 1, 1, "no-reshard"), ("paper", "fssdp", 0, 2, "micro-steps"),
    ("cluster", "fssdp", 1, 2, "micro-steps")])
def test_control_simulator_with_another_rule_differs(runs, monkeypatch, engine, policy, zero, gas, perturb):
    """Negative control: the simulator alone with another window-to-t rule (t and the search from
    half its window), without re-shards, or re-sharding by micro-step (GAS 1 on the GAS 2 run's
    counts), no longer makes the decisions derived from its inputs."""
    got, rep, _, _ = _simulated_and_derived(runs[GAS_TRACE[gas]]["trace"], monkeypatch, engine=engine,
                                            policy=policy, zero=zero, gas=gas, perturb=perturb)
    assert any((value != rep.decisions[key]).any() for key, value in got.items()), (engine, policy, perturb)

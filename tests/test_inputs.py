"""One factory for a layer's planner inputs (planner/inputs.py): the runtime, the simulator, the
pipeline stages and the replay take the policy, the policies that re-shard and the clock rule
from ``planner_inputs``, and equal settings give them equal inputs. Fails when a caller builds
one itself (a policy, a PolicyConfig, its re-shard list, a Clock, a relayed cost model)."""
import ast
import math
import pathlib
import types

import numpy as np
import pytest

from ds_fssdp import Topology
from ds_fssdp.config import FSSDPConfig
from ds_fssdp.planner import LoadPredictor
from ds_fssdp.planner import inputs as inputs_mod
from ds_fssdp.planner.baselines import FSSDPPolicy
from ds_fssdp.planner.cost import CostModel
from ds_fssdp.planner.inputs import GATHER_RELAY, ClockRule, PlannerSettings, planner_inputs
from ds_fssdp.report import replay as replay_mod
from ds_fssdp.sim import cluster as cluster_mod
from ds_fssdp.sim.setup import sim_settings
from test_sim import HW, SHAPE, skewed_tokens, small_setup

TOPO = Topology(num_ranks=8, ranks_per_node=4)  # small_setup's
ROOT = pathlib.Path(inputs_mod.__file__).resolve().parents[1]
CALLERS = ("runtime/policy_setup.py", "runtime/stage.py", "sim/cluster.py", "sim/stages.py", "sim/pipeline.py",
           "report/replay.py")
# what only the factory builds
BUILDERS = {"make_policy", "PolicyConfig", "migrating_policies", "Clock", "FSSDPPolicy"}


def tokens_of(setup, steps):
    return skewed_tokens(steps, setup, std=0.12, seed=3)


def calls_in(path: pathlib.Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None)
            if any(k.arg == "relay" and isinstance(k.value, ast.Constant) for k in node.keywords):
                names.add("relay=")  # a pricing of its own: the factory's is inputs.relay
    return names


# The replay still echoes the recorded clock (t, budget) of each decision; deriving it from the
# recorded window with the clock rule is the replay's own change (issue 48 item 4).
ECHOES = {"report/replay.py": {"Clock"}}


@pytest.mark.parametrize("caller", CALLERS)
def test_no_caller_builds_its_own_inputs(caller):
    built = calls_in(ROOT / caller) & (BUILDERS | {"relay="}) - ECHOES.get(caller, set())
    assert not built, f"{caller} builds {sorted(built)} itself: take it from planner.inputs.planner_inputs"


def test_the_structural_check_has_teeth(tmp_path):
    """Negative control: a caller that builds its own policy and clock is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ds_fssdp.planner.baselines import Clock, make_policy\n"
                   "policy = make_policy('ep', config)\nclock = Clock(overlap_degree=3)\n"
                   "cost = CostModel(hw, shape, topo, relay=True)\n")
    assert calls_in(bad) & (BUILDERS | {"relay="}) == {"make_policy", "Clock", "relay="}


def spy(monkeypatch, module, seen: list):
    def recording(settings, **kw):
        out = planner_inputs(settings, **kw)
        seen.append((module.__name__, settings, kw, out))
        return out
    monkeypatch.setattr(module, "planner_inputs", recording)


def config_fields(policy) -> dict:
    """The policy's PolicyConfig without the cost model object (compared by its prices below)."""
    c = policy.config
    return {k: getattr(c, k) for k in c.__dataclass_fields__ if k != "cost"}


def test_every_caller_gets_equal_factory_outputs(monkeypatch):
    """The runtime and the replay (planner.inputs.build_policies) and the simulator, given the same
    settings, all call the factory and get equal inputs; their planners
    hold its policy."""
    setup = small_setup()
    attn = setup.attention_fwd_s
    seen = []
    for m in (inputs_mod, cluster_mod):  # the runtime and the replay: inputs.build_policies
        spy(monkeypatch, m, seen)
    # the runtime: the "fssdp" block that says what the simulators model
    config = FSSDPConfig(policy="fssdp", overlap_degree="auto", calibration=True, calibration_latency_budget=attn,
                         reshard_interval=setup.reshard_interval, smartmoe_interval=setup.smartmoe_interval,
                         placement="paper", dispatch="paper", dispatch_slack=0.0, topology_aware=True)
    cost = CostModel(HW, SHAPE, TOPO, relay=GATHER_RELAY)
    layers = [types.SimpleNamespace(num_experts=setup.num_experts) for _ in range(setup.num_layers)]
    predictor = LoadPredictor([setup.num_experts] * setup.num_layers, window=setup.load_window)
    runtime, planners = inputs_mod.build_policies(config, num_experts=[l.num_experts for l in layers], topology=TOPO,
                                                  budget=setup.budget, cost=cost, predictor=predictor)
    assert all(p.policy is runtime.policy for p in planners)
    # the simulator, in its real mode (t from the window, calibration on, re-shards)
    run = cluster_mod.PolicyRun("fssdp", setup)
    assert all(p.policy is run.inputs.policy for ps in run.planners_BL for p in ps)
    # the replay of a run with these settings, as replay() builds its inputs
    settings = replay_mod.ReplaySettings(policy="fssdp", budget=setup.budget, overlap_degree="auto", calibration=True,
                                         calibration_latency_budget=attn, reshard_interval=setup.reshard_interval,
                                         smartmoe_interval=setup.smartmoe_interval, placement="paper",
                                         dispatch="paper", dispatch_slack=0.0, hardware=HW.__dict__,
                                         expert_shape=SHAPE.__dict__, ranks_per_node=4)
    replay_mod.build_policies(settings, num_experts=[setup.num_experts] * setup.num_layers, topology=TOPO,
                              budget=settings.budget, cost=settings.cost_model(TOPO), predictor=predictor)
    callers = [s[0] for s in seen]
    assert callers == ["ds_fssdp.planner.inputs", "ds_fssdp.sim.cluster", "ds_fssdp.planner.inputs"], callers
    outs = [s[3] for s in seen]
    flex = {"flexmoe_threshold", "flexmoe_slots", "flexmoe_interval"}  # the runtime has no FlexMoE
    for out in outs[1:]:
        a = {k: v for k, v in config_fields(outs[0].policy).items() if k not in flex}
        b = {k: v for k, v in config_fields(out.policy).items() if k not in flex}
        assert a == b
        assert [type(m) for m in out.migrators] == [type(m) for m in outs[0].migrators]
        assert out.clock_rule.overlap_degree == outs[0].clock_rule.overlap_degree == "auto"
        assert out.clock_rule.latency_budget == pytest.approx(outs[0].clock_rule.latency_budget, rel=1e-15)
        assert (out.relay, out.two_hops) == (outs[0].relay, outs[0].two_hops) == (False, True)


@pytest.mark.parametrize("name", ["ep", "uniform", "fsmoe", "smartmoe", "fssdp", "fssdp-rm"])
def test_who_re_shards(name):
    """One rule (the runtime's migrating_policies): with a re-shard interval every policy re-shards
    by Algorithm 2 (then its own permutation); the simulators' baselines run as published (interval
    0: DeepSpeed's EP never re-shards, SmartMoE its own permutation), FSSDP at the setup's interval."""
    setup = small_setup()
    runtime = planner_inputs(PlannerSettings(policy=name, reshard_interval=4), num_experts_L=[16, 16], topology=TOPO)
    assert isinstance(runtime.migrators[0], FSSDPPolicy)
    assert runtime.policy.name == ("ep" if name == "fsmoe" else name)
    sim = planner_inputs(sim_settings(name, setup, budget=setup.budget, by_window=True), num_experts_L=[16, 16],
                         topology=TOPO, cost=CostModel(HW, SHAPE, TOPO))
    fssdp = name.startswith("fssdp")
    assert [type(m).__name__ for m in sim.migrators] == (
        [type(sim.policy).__name__] if fssdp or name == "smartmoe" else [])
    tokens = tokens_of(setup, 9)
    run = cluster_mod.PolicyRun(name, setup)
    for s in range(tokens.shape[0]):
        run.step(s, tokens[s])
    assert (run.migrated > 0) == (fssdp or name == "smartmoe")  # step 8; SmartMoE's every 4 steps


def test_clock_rule():
    """The runtime's rule: t what the window buys (at most E, 0 before any window), the window's
    seconds as calibration's budget when none is given; a fixed t ignores the window."""
    cost = CostModel(HW, SHAPE, TOPO)
    auto = ClockRule(num_experts=16, overlap_degree="auto", latency_budget=None, cost=cost)
    assert auto.clock(None).overlap_degree == 0 and auto.clock(None).latency_budget == math.inf
    w = 5 * SHAPE.expert_bytes / HW.inter_bw
    c = auto.clock(w, 0.5 * w)
    assert (c.overlap_degree, c.latency_budget, c.window_s, c.attention_s) == (cost.overlap_degree(w), w, w, 0.5 * w)
    assert auto.clock(1.0).overlap_degree == 16 and auto.clock(1.0, num_experts=4).overlap_degree == 4
    fixed = ClockRule(num_experts=16, overlap_degree=3, latency_budget=2e-3)
    c = fixed.clock(w, w)
    assert (c.overlap_degree, c.latency_budget, c.window_s, c.attention_s) == (3, 2e-3, None, None)
    assert auto.reshard_clock([w, 2 * w], [w, w]) == auto.clock(w, w)


def test_settings_of_config_and_names():
    config = FSSDPConfig(policy="fssdp", rematerialize=True, overlap_degree=5, reshard_interval=7,
                         topology_aware=False)
    s = PlannerSettings.of(config, budget=4)
    assert (s.policy_name, s.budget, s.overlap_degree, s.reshard_interval, s.topology_aware) == (
        "fssdp-rm", 4, 5, 7, False)
    assert PlannerSettings(policy="fsmoe").policy_name == "ep"
    inputs = planner_inputs(s, num_experts_L=[8, 16, 8], topology=TOPO)
    assert sorted(inputs.policies) == [8, 16] and inputs.policy is inputs.policy_for(8)
    assert inputs.policy_for(16).config.num_experts == 16 and not inputs.two_hops
    assert np.isinf(inputs.policy.config.calibration_latency_budget)

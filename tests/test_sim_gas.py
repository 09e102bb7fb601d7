"""Gradient accumulation in both simulators (``Setup.gas``, ``--gas``): trace rows are micro-steps,
every one planned and priced layer by layer; the sync and the optimizer step once per optimizer
step; the re-shards after optimizer steps (the runtime's step count), never between micro-steps;
bad values refused by name."""
import io
import json

import numpy as np
import pytest

from ds_fssdp import Topology
from ds_fssdp.planner import ExpertShape, Hardware
from ds_fssdp.sim.__main__ import main
from ds_fssdp.sim.cluster import PolicyRun, simulate, simulate_cluster
from ds_fssdp.sim.setup import Setup, derive_overlap_degree
from ds_fssdp.sim.synth import synthetic_trace

SHAPE = ExpertShape(hidden=512, ffn=2048)
HW = Hardware(flops=100e12, intra_bw=200e9, inter_bw=5e9, latency=10e-6, hbm_bw=2e12)
STEPS = 12


def setup_with(*, gas=1, zero_stage=0, reshard_interval=0) -> Setup:
    topo = Topology(num_ranks=8, ranks_per_node=2)
    tokens, d = 8192, 512
    flops = 8.0 * d * d + 2.0 * 1024 * d
    return Setup(topology=topo, hw=HW, shape=SHAPE, num_layers=3, num_experts=16, tokens_per_gpu=tokens,
                 attention_flops_per_token=flops, dense_params=2 * 4 * d * d,
                 overlap_degree=derive_overlap_degree(HW, topo, SHAPE, attention_s=tokens * flops / HW.flops),
                 budget=3, budget_rm=6, flexmoe_slots=1, reshard_interval=reshard_interval, top_k=2,
                 calibration=False, zero_stage=zero_stage, load_window=2, gas=gas)


def tokens():
    return synthetic_trace(steps=STEPS, num_layers=3, num_experts=16, num_ranks=8, assignments_per_rank=2 * 8192,
                           target_std=0.15, top_k=2, seed=3).tokens_SLED


@pytest.mark.parametrize("report", [simulate, simulate_cluster])
def test_one_sync_and_one_optimizer_step_per_optimizer_step(report):
    """Without re-shards the micro-steps' layers are those of GAS 1 row for row, so an optimizer
    step of GAS 2 costs the two rows' layers, and one sync and one optimizer step, not two (one
    group: with several, the slowest group is the slowest over the step's micro-steps)."""
    t = tokens()

    def run(gas):
        return report(setup_with(gas=gas), t, ["fssdp"])[0]
    one, two = run(1), run(2)
    assert len(two.step_s) == len(one.step_s) // 2 == (STEPS - 2) // 2
    for c in ("comp", "a2a", "spag"):  # the GAS 1 rows' own parts, paired
        assert two.breakdown_s[c] == pytest.approx(2 * one.breakdown_s[c], rel=1e-9), c
    assert two.breakdown_s["opt"] == pytest.approx(one.breakdown_s["opt"], rel=1e-9)
    assert two.breakdown_s["ar"] > 0 and two.breakdown_s["ar"] < 1.5 * one.breakdown_s["ar"]
    assert two.iteration_s < 2 * one.iteration_s
    assert two.lower_bound_s is None and one.lower_bound_s is not None  # the bound prices GAS 1 only


def test_cluster_sync_once_per_optimizer_step(monkeypatch):
    """The experts' and DeepSpeed's sync is charged after each optimizer step's last micro-step, from
    that micro-step's gaps: once per two rows at GAS 2."""
    import ds_fssdp.sim.cluster as cluster
    calls = []
    charge = cluster.exposed_sync
    monkeypatch.setattr(cluster, "exposed_sync", lambda *a, **kw: calls.append(kw) or charge(*a, **kw))
    run = PolicyRun("fssdp", setup_with(gas=2), group_size=4)
    for s, t in enumerate(tokens()):
        run.step(s, t)
        assert len(calls) == (s + 1) // 2, s


def test_reshards_follow_optimizer_steps():
    """Algorithm 2 every 2 optimizer steps: at GAS 2 the owners change before rows 4 and 8 (after
    optimizer steps 2 and 4), never between an optimizer step's micro-steps; at GAS 1 before row 2."""
    t = tokens()

    def owners(gas):
        setup, decisions = setup_with(gas=gas, reshard_interval=2), []
        run = PolicyRun("fssdp", setup, group_size=8, decisions=decisions)
        for s, row in enumerate(t):
            run.step(s, row)
        return np.stack([[layer[0].numpy() for layer in step] for step in decisions])
    two, one = owners(2), owners(1)
    changed = [r for r in range(1, STEPS) if (two[r] != two[r - 1]).any()]
    assert changed and set(changed) <= {4, 8}, changed
    assert all(r % 2 == 0 for r in changed)
    assert (one[2] != one[1]).any()  # GAS 1 re-shards after its second step, row 2


def test_bad_gas_is_refused_by_name():
    with pytest.raises(ValueError, match=r"gas \(0\) must be an int >= 1"):
        setup_with(gas=0)
    with pytest.raises(ValueError, match=r"needs 8: one whole optimizer step \(4 rows\)"):
        simulate(setup_with(gas=4), tokens()[:5], ["fssdp"])
    base = ["--trace", "synthetic", "--cluster", "b", "--model", "qwen3-30b-a3b", "--gpus", "16", "--group-size", "8",
            "--steps", "6", "--json", "--no-png"]
    out = io.StringIO()
    assert main([a if a != "6" else "10" for a in base] + ["--gas", "2", "--policies", "ep,fssdp"], out=out) == 0
    data = json.loads(out.getvalue())
    assert data["setup"]["gas"] == 2 and data["lower_bound_ms"] is None and data["results"][0]["iteration_ms"] > 0
    with pytest.raises(SystemExit, match=r"--gas \(0\) must be >= 1"):
        main(base + ["--gas", "0"], out=io.StringIO())
    with pytest.raises(SystemExit, match=r"--gas \(2\) with --pipeline-stages \(2\)"):
        main(base + ["--gas", "2", "--pipeline-stages", "2"], out=io.StringIO())

"""The fitted schedule costs on 2 gloo ranks: the initial measurement and the refits from the run's
own timings give every rank the same ScheduleCosts (one spawn for every check)."""
import dataclasses
import math

import pytest
import torch

from distributed import spawn
from training import batch, ds_config, model_for

pytestmark = pytest.mark.distributed  # spawns ranks


def _worker(rank, world, tmp):
    import ds_fssdp
    from ds_fssdp.moe.experts import ExpertSpec
    from ds_fssdp.runtime import costfit
    from ds_fssdp.topology import Topology
    out = {}
    # Through the engine: SGD, 3 steps, refit every step; rank-dependent timings are agreed.
    cfg = ds_config(world=world, gas=1, fssdp={"cost_refresh_interval": 1, "metrics_csv": f"{tmp}/m{rank}.csv"})
    torch.manual_seed(0)
    model = model_for(cfg)
    engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
    stage = engine.fssdp
    out["initial"] = dataclasses.asdict(stage.schedule_costs)
    out["initial_error"] = stage.cost_fit.error
    spec = model.moe_layers()[0].spec
    for name, rpn in (("one_node", 2), ("two_nodes", 1)):
        fit = costfit.measure(group=None, topology=Topology(world, rpn), spec=spec, dtype=torch.float32, device="cpu",
                              repeats=1)
        out[name] = (dataclasses.asdict(fit.costs), fit.error, {k: len(v) for k, v in fit.base.items()})
    errors, costs, run_samples = [], [], []
    for step in range(3):
        x, y = batch(step, 0, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        errors.append(stage.last_step["cost_fit_error"])
        costs.append(dataclasses.asdict(stage.schedule_costs))
        run_samples.append({k: len(v) for k, v in stage.cost_fit.run.items()})
    out.update(errors=errors, costs=costs, run_samples=run_samples, refits=stage.cost_fit.refits,
               spans={k: len(v) for k, v in stage.shards[0].timings.spans.items()})
    # The layer units' other bytes (moe/sharded.py _other_bytes) beside what the gathers sent.
    out["layer_units"] = [list(s.timings.samples("layer_fwd")[-1][0]) for s in stage.shards]
    out["expert_bytes"] = stage.shards[1].expert_bytes
    out["early"] = [s.stats["next_gather_started_early"] for s in stage.shards]
    stage.close()
    return out


def test_costs_are_fitted_agreed_and_refitted(tmp_path):
    r0, r1 = spawn(2, _worker, str(tmp_path))
    for key in ("initial", "initial_error", "one_node", "two_nodes", "errors", "costs", "run_samples"):
        assert r0[key] == r1[key], key  # every rank fits the same costs from the same agreed samples
    # One node: intra-node samples only; two logical nodes of one rank: inter-node only.
    assert r0["one_node"][2]["intra"] == 3 and r0["one_node"][2]["inter"] == 0
    assert r0["two_nodes"][2]["inter"] == 3
    assert r0["refits"] == 3
    # Each step's forward and backward recorded 2 exchanges per layer each way: under one copy per
    # destination (the default) the rows with their gate weights as more columns, and the combined
    # rows back.
    assert r0["spans"]["a2a"] == 3 * 4 and r0["spans"]["gemm_fwd"] == r0["spans"]["gemm_bwd"] == 3
    assert r0["spans"]["layer_fwd"] == r0["spans"]["layer_bwd"] == 3
    # Layer 0's forward carries layer 1's early gather when still in flight at its start (whole
    # expert rows, one node: intra only); the last layer starts none; no backward bytes (the
    # replica reduce starts after the span).
    for r in (r0, r1):
        assert r["early"] == [True, False] and len(r["layer_units"]) == 2
        (*_, f_intra, f_inter, b_intra, b_inter), last = r["layer_units"]
        assert f_intra % r["expert_bytes"] == 0 and f_inter == b_intra == b_inter == 0.0
        assert last[4:] == [0.0, 0.0, 0.0, 0.0]
    assert r0["run_samples"][-1]["intra"] > 0 and r0["run_samples"][-1]["gemm_fwd"] == 2 * 2 * 3  # ranks x layers x steps
    assert all(math.isfinite(e) and e >= 0 for e in r0["errors"])
    c = r0["costs"][-1]
    # A GEMM over rows costs something (on these tiny experts mostly its startup) and so does its backward.
    assert c["gemm"]["startup_s"] + 64 * c["gemm"]["per_unit_s"] > 0 and c["backward_factor"] > 0
    # The step metric reaches the CSV (rank 0 writes it).
    header, *rows = (tmp_path / "m0.csv").read_text().splitlines()
    col = header.split(",").index("cost_fit_error")
    assert [float(row.split(",")[col]) for row in rows] == pytest.approx(r0["errors"])

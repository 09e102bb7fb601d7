"""Activation checkpointing around blocks with FSSDP layers is exact: a recomputed forward replays
its iteration (same placement, dispatch plan, route and replicas; replicas gathered again under
RM) instead of planning again.

Every run trains the tiny GPT-MoE through ``ds_fssdp.initialize`` on 2 gloo ranks as 2 logical
nodes (topology-aware collectives), with and without re-materialization, and is compared with
the same run without checkpointing (the recompute runs the same ops on the same values: equal
to fp32 rounding) and with the single-process reference (no checkpointing)."""
import dataclasses

import pytest
import torch

import training
from distributed import spawn
from training import ds_config, reference_train

pytestmark = pytest.mark.distributed  # spawns ranks or launches processes

WORLD, STEPS = 2, 3
MODES = ("none", "torch", "torch-reentrant", "deepspeed")
TOL = dict(rtol=2e-5, atol=2e-6)


def _runs():
    runs = {("frozen", False): ds_config(world=WORLD, zero=1, fssdp={"ranks_per_node": 1, "_frozen_experts": True})}
    for remat in (False, True):
        for mode in MODES:
            runs[(mode, remat)] = ds_config(world=WORLD, zero=1, fssdp={"ranks_per_node": 1, "rematerialize": remat})
    return runs


def _worker(rank, world, runs, steps):
    out = {}
    base = training.MODEL
    for (mode, remat), cfg in runs.items():
        training.MODEL = dataclasses.replace(base, activation_checkpointing=mode if mode in MODES else "none")
        try:
            res = training.train_worker(rank, world, {"run": cfg}, steps)["run"]
        finally:
            training.MODEL = base
        out[(mode, remat)] = {k: res[k] for k in ("losses", "dense", "experts", "replicas", "norms", "expert_states")}
    return out


@pytest.fixture(scope="module")
def trained():
    return spawn(WORLD, _worker, _runs(), STEPS)


@pytest.fixture(scope="module")
def reference():
    return reference_train(ds_config(world=WORLD, zero=1), WORLD, STEPS)


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("mode", MODES[1:])
def test_checkpointed_equals_plain_run_and_reference(trained, reference, mode, remat):
    ref_losses, ref_dense, ref_experts, ref_norms = reference
    for rank, res in enumerate(trained):
        run, plain = res[(mode, remat)], res[("none", remat)]
        assert sum(run["replicas"]) > 0  # replicas were gathered, so the replay had some to reuse
        assert run["replicas"] == plain["replicas"]  # the recompute planned nothing new
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(plain["losses"]), **TOL)
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(plain["norms"]), **TOL)
        for l, layer in enumerate(run["experts"]):
            for name, t in layer.items():
                torch.testing.assert_close(t, plain["experts"][l][name], **TOL)
                torch.testing.assert_close(t, ref_experts[l][name].float(), **TOL)
        for name, t in run["dense"].items():
            torch.testing.assert_close(t, ref_dense[name].float(), **TOL)
        gas = 2
        want = [ref_losses[(s, m, rank)] for s in range(STEPS) for m in range(gas)]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want), **TOL)
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref_norms), **TOL)


def test_frozen_fssdp_moe_experts_stay_frozen(trained):
    """Experts frozen before initialize: unchanged, no optimizer state; gate, attention and the
    rest train exactly like the single-process reference with the same experts frozen."""
    cfg = ds_config(world=WORLD, zero=1, fssdp={"_frozen_experts": True})
    ref_losses, ref_dense, ref_experts, ref_norms = reference_train(cfg, WORLD, STEPS)
    torch.manual_seed(0)
    fresh = training.GPTMoE(training.MODEL)
    initial = [l.export_experts() for l in fresh.moe_layers()]
    for rank, res in enumerate(trained):
        run = res[("frozen", False)]
        assert run["expert_states"] == [] and sum(run["replicas"]) > 0
        for l, layer in enumerate(run["experts"]):
            for name, t in layer.items():
                assert torch.equal(t, initial[l][name].float()), name
        for name, t in run["dense"].items():
            torch.testing.assert_close(t, ref_dense[name].float(), **TOL)
        assert not torch.equal(run["dense"]["blocks.0.moe.gate.weight"], fresh.blocks[0].moe.gate.weight)
        want = [ref_losses[(s, m, rank)] for s in range(STEPS) for m in range(2)]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want), **TOL)

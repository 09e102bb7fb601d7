"""Bad input and dead ranks: new config keys named in errors, unsupported combinations refused
before any collective, NaN/Inf steps skipped (or raised) before they touch any optimizer state,
and survivors that raise within the collective timeout when a rank dies or hangs (mid-step and
mid-save, the previous checkpoint staying loadable)."""
import json
import multiprocessing
import os
import queue as queue_mod
import signal
import sys
import time

import pytest
import torch
import torch.distributed

import ds_fssdp
from distributed import free_port, init_gloo, spawn
from ds_fssdp import FSSDPConfig, FSSDPConfigError, FSSDPMoE
from toy import expert_rows, toy_batch, toy_config, toy_engine, weights

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks or launches processes; > 30 s

# -- bad input: config and combinations, before any collective -------------------------------------
BAD = [
    ({"collective_timeout_s": -1}, "fssdp.collective_timeout_s (-1)"),
    ({"collective_timeout_s": "soon"}, "fssdp.collective_timeout_s ('soon')"),
    ({"nonfinite": "ignore"}, "fssdp.nonfinite ('ignore') must be one of"),
    ({"deterministic": "yes"}, "fssdp.deterministic ('yes')"),
    ({"deterministic": True, "overlap_degree": "auto"}, "fssdp.deterministic (true) refuses decisions taken from "
     "measured timings: fssdp.overlap_degree (\"auto\")"),
    ({"deterministic": True, "policy": "fastermoe"}, "fssdp.hardware (None)"),
    ({"deterministic": True, "overlap_degree": 2}, "fssdp.pipeline_degree (\"auto\") without fssdp.hardware"),
    ({"deterministic": True, "overlap_degree": 2, "pipeline_degree": 1, "one_copy_per_destination": "auto"},
     "fssdp.one_copy_per_destination (\"auto\") without fssdp.hardware"),
]


@pytest.mark.parametrize("section,message", BAD)
def test_new_keys_name_key_and_value(section, message):
    with pytest.raises(FSSDPConfigError) as err:
        FSSDPConfig.from_ds_config({"fssdp": section})
    assert message in str(err.value)


def _model(num_experts=(4, )):
    return torch.nn.Sequential(*[FSSDPMoE(hidden_size=4, ffn_hidden_size=8, num_experts=e) for e in num_experts])


@pytest.mark.parametrize("config,model,message", [
    ({"tensor_parallel": {"autotp_size": 2.5}}, (4, ), r"tensor_parallel.autotp_size \(2.5\) must be an integer"),
    ({"expert_parallel": {"enabled": True}}, (4, ), r"expert_parallel.enabled \(true\) is DeepSpeed AutoEP"),
    ({"sequence_parallel_size": 2}, (4, ), r"sequence_parallel_size \(2\)"),
    ({"fssdp": {"reshard_interval": 5}}, (4, 8), r"fssdp.reshard_interval \(5\) needs the same number of experts"),
    ({"fssdp": {"policy": "smartmoe"}}, (4, 8), r"fssdp.policy \('smartmoe'\) needs the same number of experts"),
])
def test_unsupported_combinations_refused_before_any_collective(config, model, message):
    config = dict({"train_batch_size": 2, "fssdp": {}}, **config)
    with pytest.raises(FSSDPConfigError, match=message):
        ds_fssdp.initialize(model=_model(model), config=config)
    assert not torch.distributed.is_initialized()


def test_experts_partitioned_by_zero_init_refused_before_any_collective():
    """ZeRO 3 partitions the dense parameters at initialize; experts that deepspeed.zero.Init has
    already partitioned (it marks each parameter with a ds_id) cannot be sharded by owner."""
    model = _model()
    model[0].w_a.ds_id = 0  # as zero.Init leaves a parameter
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 3}, "fssdp": {}}
    with pytest.raises(FSSDPConfigError, match=r"zero_optimization.stage \(3\): FSSDP layer 0 has expert parameters "
                                               r"\['w_a'\] partitioned by deepspeed.zero.Init"):
        ds_fssdp.initialize(model=model, config=config)
    assert not torch.distributed.is_initialized()


# -- NaN / Inf input --------------------------------------------------------------------------------
NAN_RUNS = {
    "z0-fp32": dict(zero=0),
    "z1-fp32": dict(zero=1),
    "z2-bf16": dict(zero=2, bf16=True),
    "z3-fp32": dict(zero=3),  # ZeRO 3 takes its own overflow path on the expert norm's inf
    "z0-bf16": dict(zero=0, bf16=True),
    "z0-raise": dict(zero=0, fssdp={"nonfinite": "raise"}),
    # Two FSSDP groups of one rank: the bad rank's group and the other one skip alike.
    "z0-groups": dict(zero=0, fssdp={"group_size": 1}),
    "z1-groups-partitioned": dict(zero=1, fssdp={"group_size": 1}),
}
NAN_STEP = 2
MODEL = dict(num_experts=4, k=2)


def _nan_worker(rank, world):
    out = {}
    for name, kw in NAN_RUNS.items():
        kw = dict(kw)
        fssdp = dict(kw.pop("fssdp", {}))
        engine, model = toy_engine(toy_config(world=world, gas=2, fssdp=fssdp, **kw), MODEL)
        snaps, raised, skipped, applied = [], None, [], []
        for step in range(4):
            try:
                for micro in range(2):
                    x, y = toy_batch(step, micro, rank)
                    if step == NAN_STEP and micro == 1 and rank == 1:
                        x[0, 0] = float("nan")  # one bad input on one rank
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
            except FloatingPointError as err:
                raised = str(err)
                break
            finally:
                snaps.append(dict(weights=weights(engine, model), rows=expert_rows(engine)))
            skipped.append((engine.skipped_steps, engine.fssdp.health.skipped_steps))
            applied.append(engine.fssdp.last_step["applied"])
        out[name] = dict(snaps=snaps, raised=raised, skipped=skipped, applied=applied,
                         optimizer=type(engine.optimizer).__name__)
    return out


@pytest.fixture(scope="module")
def nan_runs():
    return spawn(2, _nan_worker)


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.parametrize("name", [n for n in NAN_RUNS if "raise" not in n])
def test_nonfinite_step_is_skipped_everywhere(nan_runs, name):
    for rank in range(2):
        got = nan_runs[rank][name]
        before, at, after = got["snaps"][NAN_STEP - 1], got["snaps"][NAN_STEP], got["snaps"][NAN_STEP + 1]
        # Nothing moved at the bad step: dense and expert weights, every expert's momentum.
        assert _equal(at, before), f"{name} ({got['optimizer']}) rank {rank}: the NaN step changed the state"
        assert not _equal(after, at), f"{name}: training did not go on"
        assert all(torch.isfinite(w).all() for w in after["weights"].values())
        assert all(torch.isfinite(v).all() for row in after["rows"].values() for v in row.values()
                   if torch.is_tensor(v))
        assert got["skipped"][-1] == (1, 1) and got["applied"] == [True, True, False, True]


def test_nonfinite_step_raises_on_every_rank_when_asked(nan_runs):
    for rank in range(2):
        got = nan_runs[rank]["z0-raise"]
        assert got["raised"] is not None and f"step {NAN_STEP + 1}" in got["raised"]
        assert _equal(got["snaps"][NAN_STEP], got["snaps"][NAN_STEP - 1])
    assert "rank 1: 1 non-finite loss" in nan_runs[1]["z0-raise"]["raised"]


# -- dead and hung ranks -----------------------------------------------------------------------------
TIMEOUT_S = 5.0
_T0 = [time.monotonic()]  # when the current step began (per rank process)


def _train_until(rank, world, victim, die, steps=6):
    """Train the toy model; at step 3 the victim rank dies (SIGKILL) or hangs (SIGSTOP) inside
    the MoE layer's forward, after the gate, while the others are in the step's collectives."""
    cfg = toy_config(world=world, gas=1, fssdp={"collective_timeout_s": TIMEOUT_S})
    engine, model = toy_engine(cfg, dict(num_experts=4, k=2))
    if rank == victim:
        def pre_hook(module, args):
            if engine.global_steps == 3:
                os.kill(os.getpid(), signal.SIGKILL if die else signal.SIGSTOP)
        model.moe.register_forward_pre_hook(pre_hook)
    for step in range(steps):
        _T0[0] = time.monotonic()
        x, y = toy_batch(step, 0, rank)
        engine.backward(engine(x, y))
        engine.step()
    return "finished"


def _die_mid_save(rank, world, save_dir):
    from ds_fssdp.runtime import checkpoint
    engine, _ = toy_engine(toy_config(world=world, gas=1, fssdp={"collective_timeout_s": TIMEOUT_S}),
                           dict(num_experts=4, k=2))
    for step in range(2):
        x, y = toy_batch(step, 0, rank)
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(save_dir, tag="a")
    if rank == 1:
        real = checkpoint.write_expert_files

        def dying(engine, root, tag):
            real(engine, root, tag)
            os.kill(os.getpid(), signal.SIGKILL)  # after writing its own part: the others wait on it

        checkpoint.write_expert_files = dying
    _T0[0] = time.monotonic()
    engine.save_checkpoint(save_dir, tag="b")
    return "saved"


SCENARIOS = {
    # (ranks, the victim, what every rank runs); 2 ranks keep the process launches cheap on 2 cores.
    "killed-mid-step": (2, 1, lambda rank, world, d: _train_until(rank, world, victim=1, die=True)),
    "hung-mid-step": (2, 1, lambda rank, world, d: _train_until(rank, world, victim=1, die=False)),
    "killed-mid-save": (2, 1, _die_mid_save),
}


def _rank_main(rank, world, port, scenario, save_dir, results):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_SIZE": str(world),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    init_gloo()
    try:
        value = SCENARIOS[scenario][2](rank, world, save_dir)
        results.put((rank, "ok", value, 0.0))
    except Exception as err:  # reported to the test, which asserts on it
        results.put((rank, type(err).__name__, str(err)[:3000], time.monotonic() - _T0[0]))
    results.close()
    results.join_thread()  # the report is on its way before the hard exit below
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # do not wait in process-group teardown on a dead peer


def _run_scenario(scenario, save_dir, hard_timeout=240):
    """Plain processes (not mp.spawn, which kills the survivors as soon as one rank dies); every
    process this started is killed at the end, whatever happened."""
    world, victim, _ = SCENARIOS[scenario]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, scenario, save_dir, results)) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + hard_timeout
    try:
        while len(got) < world - 1 and time.monotonic() < deadline:
            try:
                rank, kind, value, elapsed = results.get(timeout=1.0)
                got[rank] = (kind, value, elapsed)
            except queue_mod.Empty:
                continue
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    return got, victim, world


@pytest.mark.parametrize("scenario", ["killed-mid-step", "hung-mid-step"])
def test_survivors_raise_within_the_timeout(scenario, tmp_path):
    got, victim, world = _run_scenario(scenario, str(tmp_path))
    survivors = [r for r in range(world) if r != victim]
    assert sorted(got) == survivors, f"survivors that never reported (hung?): {sorted(set(survivors) - set(got))}"
    for rank in survivors:
        kind, message, elapsed = got[rank]
        assert kind != "ok", f"rank {rank} finished training without its peer"
        # gloo sees a killed peer's connections close at once; a hung peer takes the timeout.
        assert elapsed < TIMEOUT_S + 20, (rank, elapsed, message)
        if scenario == "hung-mid-step":
            assert elapsed >= 0.8 * TIMEOUT_S, (rank, elapsed, message)


def test_rank_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    from ds_fssdp.runtime.checkpoint import consolidated_state_dict
    got, victim, world = _run_scenario("killed-mid-save", str(tmp_path))
    kind, message, elapsed = got[0]
    assert kind != "ok" and elapsed < TIMEOUT_S + 20, (kind, message, elapsed)
    assert (tmp_path / "latest").read_text() == "a"
    assert not (tmp_path / "b").exists() and (tmp_path / ".tmp-b").exists()
    state = consolidated_state_dict(str(tmp_path))  # "latest": a, every file verified
    assert state["moe.w_a"].shape[0] == 4

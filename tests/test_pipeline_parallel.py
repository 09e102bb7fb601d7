"""FSSDP inside every stage of DeepSpeed's pipeline engine, exact: 4 gloo ranks, 2 stages x 2
data-parallel ranks, G = 4 micro-batches (1F1B: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3), against
the single-process GPT-MoE on every pipeline's micro-batches (tests/pipeline_training.py).

Compared per rank: the loss train_batch returns (cross-entropy plus the routers' auxiliary terms,
what GPTMoE returns without pipelining), the pre-step gradients (dense at ZeRO 0, every owned
expert row) and global norm, this stage's dense parameters and its layers' full expert tensors.
The blocks are cut unevenly (3 MoE blocks on 2 stages; one run has a stage without any), the
skewed data places replicas and clipping engages. Negative controls: a 1 / world gradient scale,
an expert norm not summed over the pipeline, a LIFO record pop."""
import contextlib
import os

import pytest
import torch

from distributed import spawn
from pipeline_training import assert_matches, build, ds_part, pp_config, reference, train_pipeline

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks; > 30 s

WORLD, DP, STEPS = 4, 2, 2
THREE = {"n_layers": 3}  # the embedding, 3 MoE blocks, the head: stage 0 gets 2 blocks, stage 1 one
ADAM = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}}
RUNS = {
    "z0-sgd": pp_config(zero=0, model=THREE),
    "z1-sgd-rm": pp_config(zero=1, fssdp={"rematerialize": True}, model=THREE),
    # DeepSpeed's pipeline activation checkpointing: reentrant (its default) and not
    "z0-sgd-rm-ckpt": pp_config(zero=0, fssdp={"rematerialize": True}, model=THREE,
                                pipeline={"activation_checkpoint_interval": 1}),
    "z1-adamw-ckpt": pp_config(zero=1, optimizer=ADAM, model=THREE,
                               pipeline={"activation_checkpoint_interval": 1, "use_reentrant": False}),
    # FSSDP groups of one rank: EDP groups of 2 inside each stage, partitioned expert state,
    # the EDP reduce started in the gaps of the last backward
    "z1-sgd-edp": pp_config(zero=1, fssdp={"group_size": 1}, model=THREE),
    # the model's own activation checkpointing (torch's non-reentrant) inside the stages
    "z0-sgd-torch-ckpt": pp_config(zero=0, model=dict(THREE, activation_checkpointing="torch")),
    # step-level work on each stage's own groups: a re-shard every step, the routing-bias rule, the
    # schedule's cost refit
    "z0-sgd-reshard-bias": pp_config(zero=0, fssdp={"reshard_interval": 1, "router_bias_update_rate": 0.05,
                                                    "cost_refresh_interval": 1},
                                     model=dict(THREE, aux_free_bias=True)),
    # stage 1 holds the head only: no MoE layer, it still joins the step's collectives
    "z0-sgd-no-moe-stage": dict(pp_config(zero=0, model={"n_layers": 1}, fssdp={"collective_timeout_s": 120}),
                                _parts=[0, 2, 3]),
    # negative controls (must not match): DeepSpeed's world average for the experts, and an
    # expert norm summed over the stage only
    "control-world-scale": pp_config(zero=0, model=THREE),
    "control-stage-norm": pp_config(zero=0, model=THREE),
}
CONTROLS = {"control-world-scale": lambda engine: setattr(engine.fssdp, "grad_scale", 1.0 / WORLD),
            "control-stage-norm": lambda engine: setattr(engine.fssdp, "pipe_group", None)}
TOL = dict(rtol=2e-5, atol=2e-6)  # fp32 SGD: summation order only
ADAM_TOL = dict(rtol=1e-3, atol=2e-3)  # AdamW: +-lr steps on near-zero gradients (docs/environment notes)


@contextlib.contextmanager
def no_collectives():
    """Any collective inside fails (refusals must come before the first one)."""
    from deepspeed import comm as dist
    names = ("new_group", "all_reduce", "all_gather_into_tensor", "all_gather", "broadcast", "barrier",
             "all_to_all_single", "reduce_scatter_tensor", "send", "recv", "init_distributed")
    saved = {n: getattr(dist, n) for n in names}

    def fail(*args, **kwargs):
        raise RuntimeError("a collective ran before the refusal")

    for n in names:
        setattr(dist, n, fail)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _refused(make_model, config) -> str:
    import ds_fssdp
    model = make_model()
    with no_collectives():
        try:
            ds_fssdp.initialize(model=model, config=config)
        except Exception as err:  # the refusal's type and message are the result
            return f"{type(err).__name__}: {err}"
    return "not refused"


def _refusals() -> dict:
    import torch.nn as nn
    from deepspeed.pipe import PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
    from ds_fssdp.moe.layer import FSSDPMoE

    class TiedMoE(nn.Module):  # a tied module (its "weight" is what the stages tie) holding an MoE layer
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 4))
            self.moe = FSSDPMoE(hidden_size=4, ffn_hidden_size=8, num_experts=4, k=1)

        def forward(self, x):
            return x

    cfg = ds_part(pp_config())
    out = {}
    gpt = lambda: build(pp_config(model=THREE))[1]
    out["zero2"] = _refused(gpt, dict(cfg, zero_optimization={"stage": 2}))
    out["fp16-zero0"] = _refused(gpt, dict(cfg, fp16={"enabled": True}))
    out["tied"] = _refused(lambda: PipelineModule([TiedLayerSpec("moe", TiedMoE), nn.Linear(4, 4), nn.Linear(4, 4)],
                                                  num_stages=2, partition_method="uniform"), cfg)
    out["dualpipev"] = _refused(lambda: DualPipeVModule([nn.Linear(4, 4) for _ in range(4)], num_stages=2,
                                                        partition_method="uniform"), cfg)
    return out


def _refuse_schedule(engine, into: dict) -> None:
    """A schedule other than TrainSchedule, at the engine's first batch (nothing of it runs)."""
    from deepspeed.runtime.pipe import schedule

    class Other(schedule.TrainSchedule):
        pass

    engine._train_schedule = lambda: Other(micro_batches=engine.micro_batches, stages=engine.num_stages,
                                           stage_id=engine.stage_id)
    try:
        engine.train_batch(data_iter=iter([]))
        into["schedule"] = "not refused"
    except Exception as err:
        into["schedule"] = f"{type(err).__name__}: {err}"


# The resume: saved after step 1 of 3 and resumed, against the run that went on (ZeRO 1, AdamW, RM:
# every kind of state: dense and expert moments, the predictor's windows, the step counters).
RESUME = pp_config(zero=1, optimizer=ADAM, fssdp={"rematerialize": True}, model=THREE)


def _nan_loss_at_step_1(engine) -> None:
    """One micro-batch's loss on the last stage of pipeline 0 is NaN in step 1 (the second)."""
    loss_fn = engine.module.loss_fn
    first = engine.grid.get_data_parallel_id() == 0

    def nan_once(outputs, labels):
        loss = loss_fn(outputs, labels)
        return loss * float("nan") if first and engine.global_steps == 1 and engine.fssdp_pipe.backwards == 1 else loss

    engine.module.loss_fn = nan_once


def _worker(rank, world, runs: dict, steps: int, ckpt: str):
    out = {"refusals": _refusals()}
    for name, cfg in runs.items():
        save = os.path.join(ckpt, "z0") if name == "z0-sgd" else None  # resumed on another world size below
        out[name] = train_pipeline(rank, cfg, steps, engine_hook=CONTROLS.get(name), save=save)
    out["nonfinite"] = train_pipeline(rank, RUNS["z0-sgd"], STEPS, engine_hook=_nan_loss_at_step_1)
    engine_out = {}
    train_pipeline(rank, RUNS["z0-sgd"], 0, engine_hook=lambda e: _refuse_schedule(e, engine_out))
    out["refusals"].update(engine_out)
    where = os.path.join(ckpt, "z1")
    out["resume"] = (train_pipeline(rank, RESUME, 3, save=where, save_at=1),
                     train_pipeline(rank, RESUME, 3, load=where))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipeline-ckpt"))


@pytest.fixture(scope="module")
def trained(ckpt):
    return spawn(WORLD, _worker, RUNS, STEPS, ckpt)


@pytest.fixture(scope="module")
def references():
    return {name: reference(cfg, dp=DP, steps=STEPS) for name, cfg in RUNS.items()}


@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("control")])
def test_pipeline_matches_single_process(trained, references, name):
    for rank in range(WORLD):
        got = trained[rank][name]
        compared = assert_matches(got, references[name], tol=ADAM_TOL if "adam" in name else TOL, grads=True,
                                  name=f"{name} rank {rank}")
        if "z0" in name:  # ZeRO 0 keeps the averaged dense gradients in .grad
            assert compared["dense"] > 0, name
        if got["global_layers"] and "edp" not in name:  # replicated expert state: the owners' gradient rows
            assert compared["experts"] == STEPS * len(got["global_layers"]), name


@pytest.mark.parametrize("name", list(CONTROLS))
def test_negative_controls_do_not_match(trained, references, name):
    """A 1 / world expert gradient scale, or an expert norm summed over the stage only, is caught."""
    with pytest.raises(AssertionError):
        assert_matches(trained[0][name], references[name], tol=TOL, name=name)


def test_runs_engage_replicas_clipping_and_uneven_stages(trained):
    for name in ("z0-sgd", "z1-sgd-rm", "z0-sgd-rm-ckpt", "z1-adamw-ckpt"):
        by_stage = {trained[r][name]["stage"]: trained[r][name] for r in range(WORLD)}
        assert by_stage[0]["global_layers"] == [0, 1] and by_stage[1]["global_layers"] == [2], "uneven stages"
        assert max(by_stage[0]["replicas"]) > 0 and max(by_stage[1]["replicas"]) > 0, f"{name}: no replica placed"
        assert min(by_stage[0]["factors"]) < 1.0, f"{name}: clipping never engaged"
    edp = {trained[r]["z1-sgd-edp"]["stage"]: trained[r]["z1-sgd-edp"] for r in range(WORLD)}
    assert edp[0]["gaps"] == [1], "layer 1's EDP reduce did not start in the last backward's gaps"
    moved = trained[0]["z0-sgd-reshard-bias"]  # and equal to the reference above
    assert sum(sum(trained[r]["z0-sgd-reshard-bias"]["migrated"]) for r in range(WORLD)) > 0, "no expert moved"
    assert all(t["router_bias"].abs().max() > 0.04 for t in moved["experts"].values()), "the router bias never moved"
    empty = {trained[r]["z0-sgd-no-moe-stage"]["stage"]: trained[r]["z0-sgd-no-moe-stage"] for r in range(WORLD)}
    assert empty[0]["global_layers"] == [0] and empty[1]["global_layers"] == []
    assert min(empty[1]["factors"]) < 1.0  # the MoE-free stage clipped with the global norm too


def test_replica_memory_is_bounded_by_the_micro_batches_in_flight(trained):
    """1F1B keeps k = min(G, S - s) micro-batches in flight on stage s (2 on stage 0, 1 on stage 1).
    Without RM each keeps every layer's replicas until its backward: the step's peak is the largest
    sum over k consecutive micro-batches. With RM each keeps only its last layer's, plus two adjacent
    layers' while one runs: the peak is within (k - 1) * last + the largest adjacent pair."""
    G = RUNS["z0-sgd"]["gradient_accumulation_steps"]
    for rank in range(WORLD):
        plain, rm = trained[rank]["z0-sgd"], trained[rank]["z1-sgd-rm"]
        k = min(G, 2 - plain["stage"])
        assert plain["in_flight"] == k  # what the auto budget counts (planner/knobs.py)
        for step, peak in enumerate(plain["replica_peaks"]):
            per_micro = [sum(f) for f in plain["forwards"][step * G:(step + 1) * G]]
            assert peak == max(sum(per_micro[i:i + k]) for i in range(G - k + 1)), (rank, step)
        two_alive = False
        for step, peak in enumerate(rm["replica_peaks"]):
            forwards = rm["forwards"][step * G:(step + 1) * G]
            last = max(f[-1] for f in forwards)
            pair = max(max(a + b for a, b in zip(f, f[1:])) if len(f) > 1 else f[0] for f in forwards)
            assert peak <= (k - 1) * last + pair, (rank, step)
            two_alive |= k == 2 and peak > max(sum(f) for f in forwards)
        assert two_alive or k == 1, "no step held two micro-batches' replicas at once on stage 0"


def test_refused_by_name_before_any_collective(trained):
    for rank in range(WORLD):
        got = trained[rank]["refusals"]
        assert got["zero2"].startswith("FSSDPConfigError: zero_optimization.stage (2) with pipeline parallelism")
        assert got["fp16-zero0"].startswith("FSSDPConfigError: fp16.enabled (true) at zero_optimization.stage 0")
        assert got["tied"].startswith("FSSDPConfigError: fssdp layers inside a TiedLayerSpec (key 'moe', TiedMoE)")
        assert got["dualpipev"].startswith("FSSDPConfigError: fssdp with pipeline parallelism runs DeepSpeed's "
                                           "TrainSchedule (1F1B) only; the model is a DualPipeVModule")
        assert "the engine was given Other" in got["schedule"] and got["schedule"].startswith("FSSDPConfigError")


def _lifo_worker(rank, world, cfg):
    """The records popped last in first out: the backward of micro-batch 0 takes micro-batch 1's."""
    from ds_fssdp.moe.records import MicrobatchRecords
    MicrobatchRecords.backward_record = lambda self: self._queue[-1] if self._queue else None
    MicrobatchRecords.end_backward = lambda self: self._queue.pop() if self._queue else None
    return train_pipeline(rank, cfg, 1)


def test_lifo_record_pop_fails():
    """Negative control: with RM, a backward that consumes the newest forward's record re-gathers
    another micro-batch's replicas (another layout): the run fails."""
    cfg = pp_config(zero=1, fssdp={"rematerialize": True, "collective_timeout_s": 60}, model=THREE)
    with pytest.raises(Exception, match="group sizes for"):
        spawn(WORLD, _lifo_worker, cfg)


def test_resume_is_bit_exact(trained):
    """Saved after step 1, resumed in a new engine: steps 2 and 3 give the same losses, dense
    parameters and expert tensors, bitwise, as the run that went on."""
    for rank in range(WORLD):
        full, resumed = trained[rank]["resume"]
        assert full["losses"][1:] == resumed["losses"]
        assert full["dense"].keys() == resumed["dense"].keys() and full["experts"].keys() == resumed["experts"].keys()
        for n, p in full["dense"].items():
            assert torch.equal(p, resumed["dense"][n]), (rank, n)
        for g, tensors in full["experts"].items():
            for n, t in tensors.items():
                assert torch.equal(t, resumed["experts"][g][n]), (rank, g, n)


def _other_world_worker(rank, world, ckpt: str):
    """2 ranks, 2 stages of 1: resume the 4-rank ZeRO 0 and ZeRO 1 checkpoints (the same global
    batches, G = 8) and train on; and the refusals: another stage count, an engine without
    pipelining."""
    import dataclasses

    import ds_fssdp
    from ds_fssdp.models import GPTMoE
    from training import MODEL, ds_config

    def refused(model, cfg, where):
        engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
        try:
            engine.load_checkpoint(os.path.join(ckpt, where))
            return "loaded"
        except Exception as err:
            return f"{type(err).__name__}: {err}"

    # first: DeepSpeed keeps a pipeline engine's mpu in its global groups, which a later plain engine
    # of the same process trips over
    out = {"plain": refused(GPTMoE(dataclasses.replace(MODEL, n_layers=3)), ds_config(world=2, gas=4), "z0")}
    out["resumed"] = train_pipeline(rank, pp_config(dp=1, gas=8, model=THREE), 2 * STEPS, load=os.path.join(ckpt, "z0"),
                                    saved_dp=DP)
    one_stage = pp_config(dp=2, gas=4, model=THREE)
    out["stages"] = refused(build(one_stage, stages=1)[1], ds_part(one_stage), "z0")
    # ZeRO 1 with AdamW: the dense part through DeepSpeed's universal checkpoint
    out["zero1"] = train_pipeline(rank, dict(RESUME, gradient_accumulation_steps=8), 3, load=os.path.join(ckpt, "z1"),
                                  saved_dp=DP)
    return out


def _assert_resumed(resumed: dict, ref: dict, *, start: int, tol: dict, name: str) -> None:
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(ref["losses"][start:]), **tol)
    for n, p in resumed["dense"].items():
        torch.testing.assert_close(p, ref["dense"][n], **tol, msg=lambda m: f"{name} {n}: {m}")
    for g, tensors in resumed["experts"].items():
        for n, t in tensors.items():
            torch.testing.assert_close(t, ref["experts"][g][n], **tol, msg=lambda m: f"{name} layer {g} {n}: {m}")


def test_checkpoint_resumes_on_another_data_parallel_size_or_is_refused_by_name(trained, ckpt):
    """The 4-rank checkpoints (2 stages x 2) resume on 2 ranks (2 stages x 1): experts by global
    layer index under new owners, DeepSpeed's dense state (per stage at ZeRO 0, through its
    universal checkpoint at ZeRO 1), the same global batches; the steps after equal the
    single-process reference. Another stage count is refused by name."""
    got = spawn(2, _other_world_worker, ckpt)
    ref0, ref1 = reference(RUNS["z0-sgd"], dp=DP, steps=2 * STEPS), reference(RESUME, dp=DP, steps=3)
    for rank, out in enumerate(got):
        assert out["resumed"]["losses"] and out["zero1"]["losses"]
        _assert_resumed(out["resumed"], ref0, start=STEPS, tol=TOL, name=f"ZeRO 0 rank {rank}")
        _assert_resumed(out["zero1"], ref1, start=1, tol=ADAM_TOL, name=f"ZeRO 1 rank {rank}")
        assert "saved with 2 pipeline stage(s), this engine runs 1" in out["stages"], out["stages"]
        assert "saved with 2 pipeline stage(s), this engine runs 1" in out["plain"], out["plain"]


def test_a_non_finite_loss_on_the_last_stage_skips_the_step_on_every_stage(trained, references):
    """The loss flag travels with the expert squares over the stage and the pipeline: every rank
    skips step 1 (no parameter moves), so the weights after 2 steps are those after 1."""
    ref = reference(RUNS["z0-sgd"], dp=DP, steps=1)
    for rank in range(WORLD):
        got = trained[rank]["nonfinite"]
        assert got["applied"] == [True, False], (rank, got["applied"])
        for n, p in got["dense"].items():
            torch.testing.assert_close(p, ref["dense"][n], **TOL, msg=lambda m: f"rank {rank} {n}: {m}")
        for g, tensors in got["experts"].items():
            for n, t in tensors.items():
                torch.testing.assert_close(t, ref["experts"][g][n], **TOL)

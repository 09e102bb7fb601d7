"""Pipeline parallelism on 2 gloo ranks (2 stages x 1): what one stage alone would have refused is
refused on every rank before any collective; a stage without MoE layers runs the step's window
agreement, metrics and trace without hanging; the auxiliary loss's 1 / G scale has a negative
control (scale 1 must not match the single-process reference)."""
import csv
import json
import os

import pytest

from distributed import spawn
from pipeline_training import assert_matches, build, ds_part, pp_config, reference, train_pipeline
from test_pipeline_parallel import TOL, no_collectives

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks; > 30 s

WORLD = 2  # 2 stages of 1 data-parallel rank
THREE = {"n_layers": 3}
# stage 0 holds the embedding only (no MoE layer), stage 1 the 3 blocks and the head
STAGE0_EMPTY = [0, 1, 5]


def _refused(cfg: dict, *, parts=None, edit=None) -> str:
    import ds_fssdp
    _, pipe = build(dict(cfg, _parts=parts) if parts else cfg)
    if edit is not None:
        edit(pipe)
    with no_collectives():
        try:
            ds_fssdp.initialize(model=pipe, config=ds_part(cfg))
        except Exception as err:  # the refusal's type and message are the result
            return f"{type(err).__name__}: {err}"
    return "not refused"


def _freeze_one_tensor(pipe) -> None:
    """Stage 1's first block (every rank holds the modules of both stages' GPTMoE blocks)."""
    moe = pipe._layer_specs[1].block.moe
    getattr(moe, moe.spec.names[0]).requires_grad_(False)


def _refusals() -> dict:
    base = pp_config(dp=1, model=THREE)
    return {
        "bf16-zero0": _refused(dict(base, bf16={"enabled": True})),
        "bf16-zero0-no-clip": _refused(dict(base, bf16={"enabled": True}, gradient_clipping=0.0)),
        "bf16-zero1-fp32-accum": _refused(dict(base, bf16={"enabled": True}, zero_optimization={"stage": 1},
                                               data_types={"grad_accum_dtype": "fp32"})),
        # the optimizer, on a stage without MoE layers too
        "optimizer": _refused(dict(base, optimizer={"type": "Adagrad", "params": {"lr": 0.1}}), parts=STAGE0_EMPTY),
        # a fssdp value that only the stage holding the layers could judge
        "router-bias": _refused(pp_config(dp=1, model=THREE, fssdp={"router_bias_update_rate": 0.1}),
                                parts=STAGE0_EMPTY),
        # a layer of stage 1 whose expert tensors half train
        "half-frozen": _refused(base, parts=STAGE0_EMPTY, edit=_freeze_one_tensor),
        "empty-stage": _refused(base, parts=[0, 0, 5]),
    }


def _worker(rank, world, tmp: str):
    out = {"refusals": _refusals()}
    # Stage 0 without MoE layers: overlap degree "auto" and calibration agree on windows per step,
    # the metrics CSV and the trace are written for the other stage's layers.
    fssdp = {"overlap_degree": "auto", "calibration": True, "collective_timeout_s": 120,
             "metrics_csv": os.path.join(tmp, "metrics.csv"), "trace_path": os.path.join(tmp, "trace.npz")}
    out["empty-auto"] = train_pipeline(rank, dict(pp_config(dp=1, model=THREE, fssdp=fssdp), _parts=STAGE0_EMPTY), 2)
    out["sgd"] = train_pipeline(rank, pp_config(dp=1, model=THREE), 1, save=os.path.join(tmp, "z0"))
    out["z0-in-z1"] = _load(pp_config(dp=1, zero=1, model=THREE), os.path.join(tmp, "z0"))
    z1 = pp_config(dp=1, zero=1, model=THREE)
    _engine(z1).save_checkpoint(os.path.join(tmp, "z1"))
    out["z1-in-z0"] = _load(pp_config(dp=1, model=THREE), os.path.join(tmp, "z1"))
    run = lambda engine: setattr(engine.fssdp_pipe, "set_aux_scale",
                                 _times(engine.fssdp_pipe.set_aux_scale, engine.gradient_accumulation_steps()))
    out["control-aux-scale"] = train_pipeline(rank, pp_config(dp=1, model=THREE), 1, engine_hook=run)
    return out


def _engine(cfg):
    import ds_fssdp
    return ds_fssdp.initialize(model=build(cfg)[1], config=ds_part(cfg))[0]


def _load(cfg, where) -> str:
    try:
        _engine(cfg).load_checkpoint(where)
    except Exception as err:  # the refusal is the result
        return f"{type(err).__name__}: {err}"
    return "loaded"


def _times(set_scale, factor):
    """The auxiliary loss's scale without the 1 / G (negative control)."""
    return lambda scale: set_scale(scale * factor)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipeline-checks"))


@pytest.fixture(scope="module")
def ran(tmp):
    return spawn(WORLD, _worker, tmp)


def test_refused_on_every_rank_before_any_collective(ran):
    want = {
        "bf16-zero0": "FSSDPConfigError: bf16.enabled (true) at zero_optimization.stage 0 with pipeline parallelism: "
                      "DeepSpeed's BF16_Optimizer steps it, whose norm (clipping, non-finite check) counts stage 0's",
        "bf16-zero0-no-clip": "FSSDPConfigError: bf16.enabled (true) at zero_optimization.stage 0 with pipeline",
        "bf16-zero1-fp32-accum": "FSSDPConfigError: bf16.enabled (true) with data_types.grad_accum_dtype ('fp32'), "
                                 "gradient_clipping (0.3) and pipeline parallelism",
        "optimizer": "FSSDPConfigError: optimizer 'Adagrad' (optimizer.type) is not supported for fssdp experts",
        "router-bias": "FSSDPConfigError: fssdp.router_bias_update_rate (0.1) is set, but no MoE layer has a router",
        "half-frozen": "ValueError: FSSDPMoE: some expert tensors require grad and others do not",
        "empty-stage": "FSSDPConfigError: fssdp with pipeline parallelism: pipeline stage(s) [0] of 2 hold no layer "
                       "(the PipelineModule's stage boundaries [0, 0, 5])",
    }
    for rank in range(WORLD):
        got = ran[rank]["refusals"]
        for name, message in want.items():
            assert got[name].startswith(message), (rank, name, got[name])


def test_a_checkpoint_of_another_zero_kind_is_refused_by_name(ran):
    """ZeRO 0 keeps the dense optimizer state whole, ZeRO 1 partitioned: DeepSpeed reads only its own
    kind, so a resume across them (with the optimizer state) is refused before it loads anything."""
    for rank in range(WORLD):
        for name, saved, mine in (("z0-in-z1", 0, 1), ("z1-in-z0", 1, 0)):
            got = ran[rank][name]
            assert got.startswith("CheckpointError: ") and f"saved at zero_optimization.stage {saved}, this engine " \
                f"runs stage {mine}" in got, (rank, name, got)


def test_a_stage_without_moe_layers_agrees_windows_and_reports_the_other_stages_layers(ran, tmp):
    cfg = dict(pp_config(dp=1, model=THREE), _parts=STAGE0_EMPTY)
    ref = reference(cfg, dp=1, steps=2)
    for rank in range(WORLD):
        assert_matches(ran[rank]["empty-auto"], ref, tol=TOL, name=f"rank {rank}")
    assert ran[0]["empty-auto"]["global_layers"] == [] and ran[1]["empty-auto"]["global_layers"] == [0, 1, 2]
    with open(os.path.join(tmp, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2"]  # written by rank 0, which holds no MoE layer
    for layer in range(3):  # stage 1's layers, from stage 1's first rank
        assert all(float(r[f"layer{layer}/straggler"]) >= 1.0 for r in rows), layer
        assert all(int(r[f"layer{layer}/overlap_degree"]) >= 0 for r in rows), layer
    from ds_fssdp.sim.traces import load_trace
    trace = load_trace(os.path.join(tmp, "trace.npz"))  # the stage holding MoE layer 0 writes trace_path
    G = cfg["gradient_accumulation_steps"]
    assert trace.tokens_SLED.shape[:2] == (2 * G, 3)  # every forward of both steps, the 3 layers
    assert trace.meta["global_layers"] == [0, 1, 2] and trace.meta["pipeline_stage"] == 1
    assert not [f for f in os.listdir(tmp) if f.startswith("trace.stage")]
    with open(os.path.join(tmp, "trace.json")) as f:
        assert json.load(f)["num_global_layers"] == 3
    from ds_fssdp.report.check import check  # the stage's decisions, derived from its trace's inputs
    result = check(trace)
    assert result.first is None and result.pipeline_stage == (1, 2, [0, 1, 2]), result


def test_aux_loss_scale_negative_control(ran):
    """The auxiliary loss reaches the backward with 1 / G (G = 4 micro-batches here): the run
    matches the reference; with scale 1 instead, the router gradients are G times too large on the
    stages and the reference comparison fails."""
    cfg = pp_config(dp=1, model=THREE)
    ref = reference(cfg, dp=1, steps=1)
    for rank in range(WORLD):
        assert_matches(ran[rank]["sgd"], ref, tol=TOL, name=f"rank {rank}")
        with pytest.raises(AssertionError):
            assert_matches(ran[rank]["control-aux-scale"], ref, tol=TOL, name=f"control rank {rank}")

"""FSSDP groups (``fssdp.group_size``): 4 gloo ranks as 2 groups of 2 train exactly like the
single-process reference (fssdp and ep, ZeRO 0/1/2, 1 and 2 logical nodes, a group spanning two
nodes, re-materialization, re-sharding, clipping engaged); the expert optimizer state is one copy
in the world with ZeRO >= 1; bad group sizes are refused by name."""
import pytest
import torch

from distributed import spawn
from training import MODEL, assert_matches_reference, ds_config, train_worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks or launches processes; > 30 s

WORLD, STEPS = 4, 3
ADAM = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}}


def _cfg(zero, policy="fssdp", group_size=2, **kw):
    fssdp = dict({"group_size": group_size, "metrics_csv": None}, **kw.pop("fssdp", {}))
    return ds_config(world=WORLD, zero=zero, policy=policy, fssdp=fssdp, **kw)


RUNS = {
    "fssdp-z0-g2": _cfg(0),
    "fssdp-z1-g2-2nodes": _cfg(1, fssdp={"ranks_per_node": 2}),
    # Each group spans two logical nodes of one rank: topology-aware collectives inside the group.
    "fssdp-z2-g2-rpn1-rm": _cfg(2, fssdp={"ranks_per_node": 1, "rematerialize": True}),
    "ep-z1-g2": _cfg(1, policy="ep"),
    "ep-z0-g2-2nodes": _cfg(0, policy="ep", fssdp={"ranks_per_node": 2}),
    "fssdp-z1-g2-reshard": _cfg(1, fssdp={"reshard_interval": 1, "ranks_per_node": 2}),
    "fssdp-z1-g2-adamw": _cfg(1, optimizer=ADAM, gas=1),
    "smartmoe-z1-g2": _cfg(1, policy="smartmoe", fssdp={"smartmoe_interval": 1}),
    # bf16 rows accumulate their gradient in bf16 when the fp32 state is partitioned.
    "fssdp-z1-g2-bf16": _cfg(1, bf16=True),
    "fssdp-z1-g4": _cfg(1, group_size=4),
    "fssdp-z2-g1": _cfg(2, group_size=1),
}
TOL = dict(rtol=2e-5, atol=2e-6)  # fp32 SGD: summation order only (as tests/test_engine_training.py)
ADAM_TOL = dict(rtol=1e-3, atol=2e-3)
BF16_TOL = dict(rtol=3e-2, atol=3e-2)  # bf16's noise floor against the fp32 reference


@pytest.fixture(scope="module")
def trained():
    return spawn(WORLD, train_worker, RUNS, STEPS)


@pytest.mark.parametrize("name", list(RUNS))
def test_grouped_training_matches_single_process(trained, name):
    assert_matches_reference([r[name] for r in trained], RUNS[name], world=WORLD, steps=STEPS,
                             tol=ADAM_TOL if "adam" in name else BF16_TOL if "bf16" in name else TOL, name=name)
    assert min(trained[0][name]["factors"]) < 1.0, f"{name}: gradient clipping never engaged"


def test_groups_plan_replicas_and_share_owners(trained):
    """Each group of 2 owns all 8 experts (4 per rank); fssdp places replicas, ep none; a re-shard
    moves state and keeps the owners identical in both groups."""
    for rank in range(WORLD):
        assert trained[rank]["fssdp-z0-g2"]["owned"] == [4, 4]
        assert trained[rank]["fssdp-z2-g1"]["owned"] == [8, 8]
    assert max(trained[0]["fssdp-z0-g2"]["replicas"]) > 0
    assert max(trained[0]["ep-z1-g2"]["replicas"]) == 0
    from ds_fssdp.planner import homogeneous_owner
    for name in ("fssdp-z1-g2-reshard", "smartmoe-z1-g2"):
        moved = [trained[r][name] for r in range(WORLD)]
        assert sum(sum(r["migrated"]) for r in moved) > 0, f"{name}: nothing migrated"
        owners = moved[0]["owners"]
        assert any(not torch.equal(o, homogeneous_owner(MODEL.num_experts, 2)) for o in owners), f"{name}: no move"
        for r in moved[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r["owners"], owners)), f"{name}: groups disagree on owners"


def _slow_second_group_worker(rank, world, runs, steps):
    """``train_worker`` where the second group measures its link and GEMM ten times slower (what
    two groups on different hardware, or a noisy measurement, see)."""
    from ds_fssdp.runtime import profile
    real = profile.median_seconds
    profile.median_seconds = lambda fn, **kw: real(fn, **kw) * (10.0 if rank >= world // 2 else 1.0)
    return train_worker(rank, world, runs, steps)


AUTO = {"fssdp-z1-g2-auto-reshard": _cfg(1, gas=2, fssdp={"reshard_interval": 1, "ranks_per_node": 2,
                                                          "overlap_degree": "auto"})}


def test_groups_measuring_apart_still_share_one_cost_model_and_owners():
    """t "auto" re-shards with t from the measured cost model: a model measured per group gave each
    group its own t, so its own owners, and the EDP sync summed different experts (or failed on
    their sizes). The measurement is agreed over every group: one model, the same owners, and
    training equal to the single-process reference."""
    (name, cfg), = AUTO.items()
    trained = spawn(WORLD, _slow_second_group_worker, AUTO, STEPS)
    runs = [trained[r][name] for r in range(WORLD)]
    assert all(r["hardware"] == runs[0]["hardware"] for r in runs), [r["hardware"] for r in runs]
    assert sum(sum(r["migrated"]) for r in runs) > 0, "nothing migrated"
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["owners"], runs[0]["owners"])), "groups disagree on owners"
    assert_matches_reference(runs, cfg, world=WORLD, steps=STEPS, tol=TOL, name=name)


def _one_copy(row_states: int) -> int:
    """Bytes of one fp32 copy of every expert row (per row state), all layers."""
    return MODEL.n_layers * MODEL.num_experts * 2 * MODEL.d_model * MODEL.ffn_hidden * 4 * row_states


@pytest.mark.parametrize("name,groups", [("fssdp-z1-g2-2nodes", 2), ("fssdp-z1-g4", 1), ("fssdp-z2-g1", 4),
                                          ("fssdp-z1-g2-adamw", 2), ("fssdp-z0-g2", 2)])
def test_expert_state_bytes_are_one_copy_with_zero(trained, name, groups):
    """ZeRO >= 1: masters and moments summed over the world are one copy at any group size (SGD
    momentum: one row state, AdamW: two); ZeRO 0 replicates them in every group. The compute rows
    are one copy per group."""
    total = {k: sum(trained[r][name]["state_bytes"][k] for r in range(WORLD)) for k in trained[0][name]["state_bytes"]}
    copies = groups if RUNS[name]["zero_optimization"]["stage"] == 0 else 1
    row_states = 2 if "adamw" in name else 1
    assert total["expert_optimizer"] == copies * _one_copy(row_states)
    assert total["expert_master"] == copies * _one_copy(1)
    assert total["expert_params"] == groups * _one_copy(1)


BAD_GROUPS = [
    ({"group_size": 3}, 4, 4, r"fssdp.group_size \(3\) must divide the world size \(4\)"),
    ({"group_size": 4, "ranks_per_node": 3}, 12, 3, r"fssdp.group_size \(4\) must be a multiple or a divisor of "
     r"fssdp.ranks_per_node \(3\)"),
    ({"group_size": 0}, 4, 4, r"fssdp.group_size \(0\) must be null or an int >= 1"),
    ({"group_size": "two"}, 4, 4, r"fssdp.group_size \('two'\) must be null or an int >= 1"),
]


@pytest.mark.parametrize("section,world,rpn,message", BAD_GROUPS)
def test_bad_group_size_is_refused_by_name(section, world, rpn, message):
    from ds_fssdp import FSSDPConfig, FSSDPConfigError
    with pytest.raises(FSSDPConfigError, match=message):
        FSSDPConfig.from_ds_config({"fssdp": section}).resolve_group_size(world, rpn)


def test_group_size_resolution_and_ep_size():
    from ds_fssdp import FSSDPConfig, FSSDPConfigError
    cfg = FSSDPConfig.from_ds_config({"fssdp": {}})
    assert cfg.group_size is None and cfg.resolve_group_size(8, 4) == 8
    assert cfg.resolve_group_size(8, 4, 2, "moe.ep_size") == 2
    assert FSSDPConfig.from_ds_config({"fssdp": {"group_size": 8}}).resolve_group_size(16, 4) == 8
    with pytest.raises(FSSDPConfigError, match=r"fssdp.group_size \(4\) conflicts with moe.ep_size \(2\)"):
        FSSDPConfig.from_ds_config({"fssdp": {"group_size": 4}}).resolve_group_size(8, 4, 2, "moe.ep_size")
    with pytest.raises(FSSDPConfigError, match=r"moe.ep_size \(3\) must divide the world size \(8\)"):
        cfg.resolve_group_size(8, 4, 3, "moe.ep_size")


def test_moe_ep_size_is_the_group_size():
    """``ds_fssdp.MoE(ep_size=N)`` asks initialize for group size N; layers that disagree are
    refused naming both (before any collective)."""
    import torch.nn as nn
    import ds_fssdp
    from ds_fssdp import FSSDPConfigError
    from ds_fssdp.runtime.engine import requested_group_size
    template = lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    one = nn.ModuleList([ds_fssdp.MoE(4, template(), num_experts=4, ep_size=2) for _ in range(2)])
    assert requested_group_size(one) == (2, "0.ep_size")
    assert requested_group_size(nn.ModuleList([ds_fssdp.MoE(4, template(), num_experts=4)])) == (None, "")
    two = nn.ModuleList([ds_fssdp.MoE(4, template(), num_experts=4, ep_size=s) for s in (2, 4)])
    with pytest.raises(FSSDPConfigError, match=r"0.ep_size \(2\), 1.ep_size \(4\)"):
        requested_group_size(two)
    with pytest.raises(ValueError, match=r"ep_size \(0\) must be an int >= 1"):
        ds_fssdp.MoE(4, template(), num_experts=4, ep_size=0)


# -- checkpoints at group size 2 -------------------------------------------------------------------
CKPT = _cfg(1, optimizer=ADAM, gas=1, fssdp={"reshard_interval": 1, "ranks_per_node": 2})
N, M = 2, 2  # steps before the save, steps after it


def _state(engine, model) -> dict:
    """Everything a resume must restore, with each layer's full expert state gathered from the
    EDP slices (collective)."""
    stage = engine.fssdp
    full = [stage.expert_state.full_state(l) for l in range(len(stage.shards))]
    return dict(dense={n: p.detach().clone() for n, p in engine.module.named_parameters()},
                experts=[{k: v.clone() for k, v in l.export_experts().items()} for l in model.moe_layers()],
                masters=[m.clone() for m, _, _ in full],
                rows=[{k: v.clone() for k, v in r.items()} for _, r, _ in full],
                scalars=[{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for _, _, s in full],
                owners=[s.owner_E.clone() for s in stage.shards], steps=stage.steps,
                predictor=stage.predictor.state_dict(), state_bytes=stage.state_bytes())


def _checkpoint_worker(rank, world, root):
    import copy
    import ds_fssdp
    from ds_fssdp.models import GPTMoE
    from test_checkpoint import _train

    def engine(seed):
        torch.manual_seed(seed)
        model = GPTMoE(MODEL)
        return ds_fssdp.initialize(model=model, config=copy.deepcopy(CKPT))[0], model

    e1, m1 = engine(0)
    _train(e1, rank, N, 0)
    e1.save_checkpoint(root, tag="g2")
    saved = _state(e1, m1)
    cont = _train(e1, rank, M, N)
    e2, m2 = engine(1234)  # other initial weights: everything must come from the checkpoint
    e2.load_checkpoint(root)
    loaded = _state(e2, m2)
    resumed = _train(e2, rank, M, N)
    return dict(saved=saved, loaded=loaded, cont=cont, resumed=resumed, final1=_state(e1, m1), final2=_state(e2, m2))


def test_checkpoint_round_trip_at_group_size_2(tmp_path):
    """Save with the AdamW state partitioned over the EDP group (after re-shards), load into a
    fresh engine: every expert's master and moments (gathered), owners, dense weights and
    predictor are the saved ones, and training continues bit-identically."""
    import os
    from test_checkpoint import _assert_same as _same
    results = spawn(WORLD, _checkpoint_worker, str(tmp_path))
    for rank, got in enumerate(results):
        _same(got["loaded"], got["saved"], f"rank {rank} loaded")
        assert got["resumed"] == got["cont"], f"rank {rank}: losses differ"
        _same(got["final2"], got["final1"], f"rank {rank} final")
        assert all(r["exp_avg_sq"].abs().sum() > 0 for r in got["saved"]["rows"]), "Adam moments not exercised"
    assert results[0]["saved"]["state_bytes"]["expert_optimizer"] == _one_copy(2) // WORLD
    from ds_fssdp.runtime.checkpoint import load_file, rank_file
    files = [load_file(os.path.join(tmp_path, "g2", rank_file(r))) for r in range(WORLD)]
    assert [len(f["layers"]) for f in files] == [MODEL.n_layers] * 2 + [0] * 2, "only the first group holds experts"


# -- the experts' gradient sync in DeepSpeed's communication dtype -----------------------------------
# 2 gloo ranks as 2 FSSDP groups of 1 (an EDP group of 2) in bf16: the sync sends bf16 by default and
# fp32 with "communication_data_type": "fp32" (planner/sync_dtype.py, runtime/expert_dp.py).
COMM_WORLD, COMM_STEPS, COMM_SLICE = 2, 2, 200  # forced gap slices of 200 bytes: many per layer


def _comm_cfg(zero, comm=None, gaps=False):
    cfg = ds_config(world=COMM_WORLD, zero=zero, bf16=True,
                    fssdp={"group_size": 1, "metrics_csv": None, "grads_in_gaps": gaps})
    return cfg if comm is None else dict(cfg, communication_data_type=comm)


COMM_RUNS = {  # name: (config, forced split from the second step)
    "z0": (_comm_cfg(0), False),
    "z0-fp32comm": (_comm_cfg(0, "fp32"), False),
    "z0-gaps-split": (_comm_cfg(0, gaps=True), True),
    "z1": (_comm_cfg(1), False),
    "z1-fp32comm": (_comm_cfg(1, "fp32"), False),
    "z1-gaps": (_comm_cfg(1, gaps=True), False),
}


class _RecordingComm:
    """deepspeed.comm as runtime/expert_dp.py calls it, recording each collective's name and the
    dtype it sends."""

    def __init__(self, inner, ops: list):
        self.inner, self.ops = inner, ops

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_reduce(self, tensor, *args, **kwargs):
        self.ops.append(("all_reduce", tensor.dtype))
        return self.inner.all_reduce(tensor, *args, **kwargs)

    def reduce_scatter_tensor(self, out, tensor, *args, **kwargs):
        self.ops.append(("reduce_scatter", tensor.dtype))
        return self.inner.reduce_scatter_tensor(out, tensor, *args, **kwargs)

    def all_gather_into_tensor(self, out, tensor, *args, **kwargs):
        self.ops.append(("all_gather", tensor.dtype))
        return self.inner.all_gather_into_tensor(out, tensor, *args, **kwargs)


def _comm_worker(rank, world, runs, steps):
    """Each run's training (train_worker) with the expert sync's collectives recorded, and at every
    step the gradient each layer reduces (before the reduce: the fp32 master gradient, or the rows'
    gradient in fp32; runs without gradients in the gaps only) and this rank's fp32 slice of the
    reduced one."""
    import ds_fssdp.runtime.expert_dp as expert_dp
    from ds_fssdp.runtime.edp_sync import EDPSyncPlan
    from ds_fssdp.runtime.stage import FSSDPStage
    originals = {"before_step": FSSDPStage.before_step, "attach": FSSDPStage.attach,
                 "decide_split": EDPSyncPlan.decide_split, "dist": expert_dp.dist}
    out = {}
    for name, (cfg, split) in runs.items():
        ops, sent, reduced, sq, seen = [], [], [], [], {}

        def before_step(self, engine, _orig=originals["before_step"]):
            state = self.expert_state
            if state.partitioned:
                sent.append([None if s.rows.grad is None else s.rows.grad.float().clone() for s in self.shards])
            else:
                sent.append([None if s.master.grad is None else s.master.grad.clone() for s in self.shards])
            _orig(self, engine)
            reduced.append([p.grad.clone() if state.partitioned else state.reduced_slice(i).clone()
                            for i, p in enumerate(self.masters())])
            sq.append(self.norm.expert_sq.clone())

        def attach(self, engine, _orig=originals["attach"], _gaps=cfg["fssdp"].get("grads_in_gaps")):
            _orig(self, engine)
            seen.update(comm_dtype=self.expert_state.comm_dtype, grad_bytes=self.edp_sync.grad_bytes,
                        engine_dtype=engine.communication_data_type, grad_scale=self.grad_scale)
            if _gaps:
                self.edp_sync.slice_bytes = [COMM_SLICE] * len(self.shards)

        def decide_split(self, device, *, attention_s, schedule_costs, _split=split):
            return _split

        FSSDPStage.before_step, FSSDPStage.attach, EDPSyncPlan.decide_split = before_step, attach, decide_split
        expert_dp.dist = _RecordingComm(originals["dist"], ops)
        try:
            res = train_worker(rank, world, {name: cfg}, steps)[name]
        finally:
            FSSDPStage.before_step, FSSDPStage.attach = originals["before_step"], originals["attach"]
            EDPSyncPlan.decide_split, expert_dp.dist = originals["decide_split"], originals["dist"]
        out[name] = dict(res, ops=ops, sent=sent, reduced=reduced, sq=sq, **seen)
    return out


@pytest.fixture(scope="module")
def comm_trained():
    return spawn(COMM_WORLD, _comm_worker, COMM_RUNS, COMM_STEPS)


@pytest.mark.parametrize("name", list(COMM_RUNS))
def test_the_expert_sync_sends_deepspeeds_communication_dtype(comm_trained, name):
    """bf16 by default, fp32 where the config says so: every reduce (all-reduce at ZeRO 0, the
    reduce-scatters at ZeRO 1 and of a split step, the slices in the gaps) and a split step's
    all-gather of the summed gradient; the engine's own dtype the same."""
    want = torch.float32 if "fp32comm" in name else torch.bfloat16
    for rank in range(COMM_WORLD):
        got = comm_trained[rank][name]
        assert got["comm_dtype"] == got["engine_dtype"] == want
        assert got["grad_bytes"] == want.itemsize
        reduces = [d for op, d in got["ops"] if op in ("all_reduce", "reduce_scatter")]
        gathers = [d for op, d in got["ops"] if op == "all_gather"]
        assert reduces and set(reduces) == {want}, f"{name} rank {rank}: {got['ops']}"
        if "gaps" in name:  # forced small slices: many collectives per layer and step
            assert len(reduces) > 4 * MODEL.n_layers * COMM_STEPS
        if name.startswith("z1") or "split" in name:  # the stepped rows (bf16) or the summed gradient
            assert gathers and set(gathers) == {torch.bfloat16}, f"{name} rank {rank}: {got['ops']}"
        else:
            assert not gathers


@pytest.mark.parametrize("name", ["z0", "z0-fp32comm", "z1", "z1-fp32comm"])
def test_the_expert_sync_equals_a_reference_with_the_same_casts(comm_trained, name):
    """Each layer's reduced gradient, every step, on both ranks: each rank's gradient times the
    scale in fp32, cast to the communication dtype, summed in it (two ranks: one rounding), back in
    fp32; bitwise (with fp32 communication: the fp32 sum, as before the option). The norm's expert
    part is the fp32 squares of it (summation order only)."""
    comm = torch.float32 if "fp32comm" in name else torch.bfloat16
    ranks = [comm_trained[r][name] for r in range(COMM_WORLD)]
    scale = ranks[0]["grad_scale"]
    for step in range(COMM_STEPS):
        squares = 0.0
        for layer in range(MODEL.n_layers):
            summed = sum((r["sent"][step][layer].reshape(-1) * scale).to(comm) for r in ranks).float()
            squares += float(summed.double().pow(2).sum())
            for j, r in enumerate(ranks):
                want = summed.split([summed.numel() // COMM_WORLD] * COMM_WORLD)[j]
                torch.testing.assert_close(r["reduced"][step][layer], want, rtol=0, atol=0,
                                           msg=lambda m: f"{name} step {step} layer {layer} rank {j}: {m}")
        for r in ranks:
            assert float(r["sq"][step]) == pytest.approx(squares, rel=1e-5)


@pytest.mark.parametrize("gaps,sync", [("z0-gaps-split", "z0"), ("z1-gaps", "z1")])
def test_bf16_sync_in_the_gaps_and_split_equals_the_sync_at_the_step_bitwise(comm_trained, gaps, sync):
    """The same sums in bf16 whether reduced at the step, in sliced collectives during the
    backward, or split around the step (a reduce-scatter, the summed slices all-gathered in bf16):
    the same reduced gradients, losses and weights."""
    for rank in range(COMM_WORLD):
        a, b = comm_trained[rank][gaps], comm_trained[rank][sync]
        assert a["losses"] == b["losses"], f"{gaps} rank {rank}: losses differ"
        for step, (x, y) in enumerate(zip(a["reduced"], b["reduced"])):
            for layer, (u, v) in enumerate(zip(x, y)):
                assert torch.equal(u, v), f"{gaps} rank {rank} step {step} layer {layer}"
        for layer, (u, v) in enumerate(zip(a["experts"], b["experts"])):
            assert all(torch.equal(u[k], v[k]) for k in v), f"{gaps} rank {rank} layer {layer}: weights differ"


def test_a_bad_communication_data_type_is_refused_by_name_before_any_collective(monkeypatch):
    """DeepSpeed refuses it only in its initialize, after FSSDP's groups are built; FSSDP's
    initialize refuses it first, naming the key and the value."""
    import copy
    import ds_fssdp
    import ds_fssdp.runtime.engine as runtime_engine
    from ds_fssdp.models import GPTMoE

    def no_collective(*args, **kwargs):
        raise AssertionError("init_distributed reached")

    monkeypatch.setattr(runtime_engine, "init_distributed", no_collective)
    for key in ("communication_data_type", "seq_parallel_communication_data_type"):
        cfg = dict(copy.deepcopy(_comm_cfg(0)), **{key: "int8"})
        with pytest.raises(ValueError, match=rf"^{key} \('int8'\) must be one of 'fp32', 'bf16', 'fp16'"):
            ds_fssdp.initialize(model=GPTMoE(MODEL), config=cfg)

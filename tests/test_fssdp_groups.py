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

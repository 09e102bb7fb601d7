"""Checkpoints through the engine: exact resume across a re-shard (and under ZeRO 3), loading on
another world size or ranks_per_node with every expert's state intact and ZeRO 1/3's dense state
through DeepSpeed's universal checkpoint, a consolidated export, atomic saves, and safe loading that
names the bad file on every rank (no rank left hanging)."""
import copy
import json
import os
import pathlib
import shutil

import pytest
import torch

import resume_world
from distributed import spawn
from toy import expert_rows
from training import MODEL, ds_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns ranks or launches processes; > 30 s

ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}}
NO_CSV = {"metrics_csv": None}


def _cfg(world, **kw):
    fssdp = dict(NO_CSV, **kw.pop("fssdp", {}))
    return ds_config(world=world, fssdp=fssdp, **kw)


def _engine(cfg, seed=0):
    import ds_fssdp
    from ds_fssdp.models import GPTMoE
    torch.manual_seed(seed)
    model = GPTMoE(MODEL)
    engine, *_ = ds_fssdp.initialize(model=model, config=copy.deepcopy(cfg))
    return engine, model


_train = resume_world.train


def _clock(engine) -> tuple:
    """The agreed windows and their attention parts (measured: equal only where one is restored)."""
    return list(engine.fssdp.window_s), list(engine.fssdp.attention_s)


def _snapshot(engine, model) -> dict:
    return dict(dense={n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
                experts=[{k: v.float() for k, v in l.export_experts().items()} for l in model.moe_layers()],
                rows=expert_rows(engine), owners=[s.owner_E.clone() for s in engine.fssdp.shards],
                steps=engine.fssdp.steps, global_steps=engine.global_steps, lr=engine.get_lr(),
                rng=torch.get_rng_state(), predictor=engine.fssdp.predictor.state_dict())


# Three launches carry every check of this file (each launch of 4 ranks costs ~10 s on 2 cores):
# 4 ranks (exact resume; the checkpoint to re-shard), 2 ranks (load it on 2; atomic saves and bad
# files), 4 ranks again (load the 2-rank checkpoint, and the 4-rank one with other ranks_per_node).
def _four_worker(rank, world, root):
    return {"resume": _resume_worker(rank, world, os.path.join(root, "resume")),
            "saved": _save_on_4(rank, world, os.path.join(root, "reshard")),
            "zero3": resume_world.zero3_round_trip(rank, world, os.path.join(root, "zero3")),
            "world": resume_world.save_all(rank, world, os.path.join(root, "world")),
            "group": resume_world.group_change(rank, world, os.path.join(root, "group"))}


def _two_worker(rank, world, root):
    return {"load2": _load_on_2(rank, world, os.path.join(root, "reshard")),
            "safety": _safety_worker(rank, world, os.path.join(root, "safety")),
            "world": dict(loaded=resume_world.load_all(rank, world, os.path.join(root, "world"), 4),
                          saved=resume_world.save_all(rank, world, os.path.join(root, "world")))}


def _four_again_worker(rank, world, root):
    out = _load_on_4_other_rpn(rank, world, os.path.join(root, "reshard"))
    # New processes resume the first launch's checkpoint.
    name = "fssdp-z0-sgd-reshard"
    engine, model = _engine(RESUME[name], seed=4321)
    engine.load_checkpoint(os.path.join(root, "resume", name))
    out["fresh_process_resume"] = dict(losses=_train(engine, rank, M, N), final=_snapshot(engine, model))
    out["world"] = resume_world.load_all(rank, world, os.path.join(root, "world"), 2)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def four(root):
    return spawn(4, _four_worker, root)


@pytest.fixture(scope="module")
def two(root, four):
    return spawn(2, _two_worker, root)


@pytest.fixture(scope="module")
def four_again(root, two):
    return spawn(4, _four_again_worker, root)


@pytest.fixture(scope="module")
def resumed(four):
    return [r["resume"] for r in four]


@pytest.fixture(scope="module")
def resharded(root, four, two, four_again):
    return os.path.join(root, "reshard"), [r["saved"] for r in four], [r["load2"] for r in two], four_again


@pytest.fixture(scope="module")
def safety(two):
    return [r["safety"] for r in two]


# -- 1. exact resume -----------------------------------------------------------------------------
RESUME = {
    "fssdp-z0-sgd-reshard": _cfg(4, zero=0, scheduler=WARMUP, fssdp={"reshard_interval": 2, "ranks_per_node": 2}),
    "ep-z0-sgd": _cfg(4, zero=0, gas=1, policy="ep"),
    "fssdp-z1-adamw-reshard": _cfg(4, zero=1, gas=1, optimizer=ADAMW, fssdp={"reshard_interval": 2}),
    # t by time from the agreed windows and their attention parts: the clock a checkpoint carries
    "fssdp-z0-auto-t": _cfg(4, zero=0, gas=1, fssdp={"overlap_degree": "auto", "ranks_per_node": 2,
                                                     "hardware": {"flops": 1e6, "intra_bw": 1e9, "inter_bw": 1e7}}),
}
N, M = 3, 3  # steps before the save, steps after it


def _resume_worker(rank, world, root):
    out = {}
    for name, cfg in RESUME.items():
        engine, model = _engine(cfg)
        _train(engine, rank, N, 0)
        engine.save_checkpoint(os.path.join(root, name), tag=f"step{N}")
        saved = dict(_snapshot(engine, model), clock=_clock(engine))
        cont = _train(engine, rank, M, N)
        final = _snapshot(engine, model)
        # A fresh engine from other initial weights: everything must come from the checkpoint.
        engine2, model2 = _engine(cfg, seed=1234)
        engine2.load_checkpoint(os.path.join(root, name))  # through "latest"
        loaded = dict(_snapshot(engine2, model2), clock=_clock(engine2))
        resumed = _train(engine2, rank, M, N)
        out[name] = dict(saved=saved, cont=cont, final=final, loaded=loaded, resumed=resumed,
                         final2=_snapshot(engine2, model2))
    return out




def _assert_same(a, b, what):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_same(a[k], b[k], f"{what}[{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{what}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), what
    else:
        assert a == b, what


@pytest.mark.parametrize("name", list(RESUME))
def test_resume_is_bit_identical(resumed, name):
    for rank in range(4):
        got = resumed[rank][name]
        # The loaded engine is the saved one: weights, every expert's optimizer rows, owners after
        # the re-shard, steps, LR schedule, predictor windows, RNG.
        _assert_same(got["loaded"], got["saved"], f"{name} rank {rank} loaded")
        # ... and it trains on exactly as the uninterrupted run: losses and final state.
        assert got["resumed"] == got["cont"], f"{name} rank {rank}: losses differ"
        _assert_same(got["final2"], got["final"], f"{name} rank {rank} final")
    if name == "fssdp-z0-auto-t":  # the restored clock is a measured one
        windows, attentions = resumed[0][name]["loaded"]["clock"]
        assert all(0.0 < a <= w for w, a in zip(windows, attentions)), (windows, attentions)


def test_resume_in_fresh_processes(resumed, four_again):
    name = "fssdp-z0-sgd-reshard"
    for rank in range(4):
        got, want = four_again[rank]["fresh_process_resume"], resumed[rank][name]
        assert got["losses"] == want["cont"], f"rank {rank}: losses differ"
        _assert_same(got["final"], want["final"], f"rank {rank} final")


def test_resume_spans_reshards(resumed):
    from ds_fssdp.planner import homogeneous_owner
    got = resumed[0]["fssdp-z0-sgd-reshard"]
    even = [homogeneous_owner(MODEL.num_experts, 4)] * MODEL.n_layers
    assert any(not torch.equal(a, b) for a, b in zip(got["saved"]["owners"], even)), "no re-shard before the save"
    assert any(not torch.equal(a, b) for a, b in zip(got["final"]["owners"], got["saved"]["owners"])), \
        "no re-shard after the load"
    assert all(v["exp_avg"].abs().sum() > 0 for k, v in resumed[0]["fssdp-z1-adamw-reshard"]["saved"]["rows"].items()
               if k[1] is not None), "Adam moments were not exercised"


# -- 2. reshard on load, consolidated export ------------------------------------------------------
SAVED_ON_4 = _cfg(4, zero=0, gas=1, optimizer=ADAMW, fssdp={"reshard_interval": 1, "ranks_per_node": 2})


def _all_rows(per_rank: list) -> dict:
    rows = {}
    for part in per_rank:
        for key, value in part.items():
            if key[1] is None:
                assert rows.setdefault(key, value).keys() == value.keys()
            else:
                assert key not in rows, f"expert {key} owned twice"
                rows[key] = value
    return rows


def _save_on_4(rank, world, root):
    engine, model = _engine(SAVED_ON_4)
    _train(engine, rank, 3, 0)
    engine.save_checkpoint(root, tag="a")
    snap = _snapshot(engine, model)
    z1, _ = _engine(_cfg(4, zero=1, gas=1))  # SGD: no universal checkpoint for it (Adam only)
    _train(z1, rank, 2, 0)
    z1.save_checkpoint(root, tag="zero1")
    return dict(snap, z1_rows=expert_rows(z1))


def _load_on_2(rank, world, root):
    from ds_fssdp.runtime.checkpoint import CheckpointError
    engine, model = _engine(_cfg(2, zero=0, gas=1, optimizer=ADAMW, fssdp={"reshard_interval": 1}), seed=7)
    engine.load_checkpoint(root, tag="a")
    got = _snapshot(engine, model)
    engine.save_checkpoint(root, tag="b")  # the same state, saved by 2 ranks
    trained = _train(engine, rank, 1, 3)  # and it trains with the new owners
    sizes = [tuple(st["exp_avg"].shape) for st in engine.fssdp.optimizer.state.values()]
    z1, _ = _engine(_cfg(2, zero=1, gas=1), seed=7)
    with pytest.raises(CheckpointError) as refused:
        z1.load_checkpoint(root, tag="zero1")
    z1.load_checkpoint(root, tag="zero1", load_optimizer_states=False, load_expert_optimizer_states=True)
    return dict(got, trained=trained, sizes=sizes, owned=[s.owned_E.numel() for s in engine.fssdp.shards],
                refused=str(refused.value), z1_rows=expert_rows(z1))


def _load_on_4_other_rpn(rank, world, root):
    out = {}
    for tag in ("b", "a"):  # b: saved on 2 ranks; a: saved on 4 ranks with ranks_per_node 2
        engine, model = _engine(_cfg(4, zero=0, gas=1, optimizer=ADAMW, fssdp={"ranks_per_node": 1}), seed=8)
        engine.load_checkpoint(root, tag=tag)
        out[tag] = _snapshot(engine, model)
    return out




def test_load_on_other_world_sizes_keeps_every_expert(resharded):
    from ds_fssdp.planner import homogeneous_owner
    root, on4, on2, back4 = resharded
    even = lambda world: homogeneous_owner(MODEL.num_experts, world)
    assert any(not torch.equal(o, even(4)) for o in on4[0]["owners"]), "the saved owners were never re-sharded"
    want = _all_rows([r["rows"] for r in on4])
    assert len(want) == MODEL.n_layers * (MODEL.num_experts + 1)
    for label, results, world in (("4->2", on2, 2), ("2->4, ranks_per_node 1", [r["b"] for r in back4], 4),
                                  ("4, ranks_per_node 2->1", [r["a"] for r in back4], 4)):
        # Master rows, Adam moments and step of every (layer, expert), whoever owns it now.
        _assert_same(_all_rows([r["rows"] for r in results]), want, label)
        for r in results:
            assert all(torch.equal(o, even(world)) for o in r["owners"]), label
            _assert_same(r["dense"], on4[0]["dense"], label)
            _assert_same(r["experts"], on4[0]["experts"], label)
            assert (r["steps"], r["global_steps"]) == (on4[0]["steps"], on4[0]["global_steps"]), label
            # The predictor's windows keep their per-expert totals.
            for hist, ref in zip(r["predictor"]["history"], on4[0]["predictor"]["history"]):
                assert len(hist) == len(ref) and all(torch.equal(h.sum(1), g.sum(1)) for h, g in zip(hist, ref))
    for r in on2:  # and the 2-rank engine trains on with its new owners
        assert all(torch.isfinite(torch.tensor(r["trained"])))
        assert [s[0] for s in r["sizes"]] == r["owned"]


def test_zero_world_change_without_universal_support_is_refused_clearly(resharded):
    """SGD's momentum has no place in DeepSpeed's universal checkpoint: refused by name before
    anything is read; without the dense optimizer state the experts' state still loads."""
    root, on4, on2, _ = resharded
    for r in on2:
        for words in ("saved on 4 ranks with ZeRO stage 1 and optimizer SGD", "Adam-family optimizers only",
                      "load_optimizer_states=False"):
            assert words in r["refused"], r["refused"]
    _assert_same(_all_rows([r["z1_rows"] for r in on2]), _all_rows([r["z1_rows"] for r in on4]), "zero1 experts")


@pytest.mark.parametrize("direction", ["4->2", "2->4"])
@pytest.mark.parametrize("name", list(resume_world.RUNS))
def test_zero_world_change_through_universal_checkpoint(root, four, two, four_again, name, direction):
    """A ZeRO 1/3 checkpoint loads on another world size: every dense fp32 master and Adam moment
    (re-partitioned by DeepSpeed's universal checkpoint), every expert's master and moments, the
    steps and the LR equal the saved ones, and training continues."""
    saved, loaded = ((four, [r["world"]["loaded"] for r in two]) if direction == "4->2" else
                     ([{"world": r["world"]["saved"]} for r in two], [r["world"] for r in four_again]))
    want = saved[0]["world"][name]
    assert want["moments"], "no dense optimizer moments to compare"
    rows = _all_rows([r["world"][name]["rows"] for r in saved])
    assert len(rows) == MODEL.n_layers * (MODEL.num_experts + 1)
    _assert_same(_all_rows([r[name]["rows"] for r in loaded]), rows, f"{name} {direction} expert rows")
    for rank, r in enumerate(loaded):
        got = r[name]
        for key in ("dense", "moments", "experts", "global_steps", "stage_steps", "lr"):
            _assert_same(got[key], want[key], f"{name} {direction} rank {rank} {key}")
        assert all(torch.isfinite(torch.tensor(got["next_losses"]))), f"{name} {direction}: training stopped"
    assert os.path.isdir(os.path.join(root, "world", name, ".universal-on" + direction[0]))


def test_resume_at_another_group_size(four):
    """Saved with FSSDP groups of 2 on 4 ranks (expert masters and moments partitioned over the
    EDP pairs), loaded into one group of 4: every dense master and moment, every expert's row and
    moments, the steps and the LR equal the saved ones, and training continues."""
    rows = _all_rows([r["group"]["saved"]["rows"] for r in four])
    assert len(rows) == MODEL.n_layers * (MODEL.num_experts + 1)
    _assert_same(_all_rows([r["group"]["loaded"]["rows"] for r in four]), rows, "group 2 -> 4 expert rows")
    for rank, r in enumerate(four):
        got, want = r["group"]["loaded"], r["group"]["saved"]
        assert want["moments"]
        for key in ("dense", "moments", "experts", "global_steps", "stage_steps", "lr"):
            _assert_same(got[key], want[key], f"group 2 -> 4 rank {rank} {key}")
        assert all(torch.isfinite(torch.tensor(got["next_losses"])))


def test_zero3_resume_is_exact(root, four):
    """ZeRO 3 on the same ranks: the loaded engine is the saved one (dense masters and moments
    whole, experts, steps), and it trains on exactly as the run that never stopped; the
    consolidated export gathers ZeRO 3's dense partitions (DeepSpeed's zero_to_fp32)."""
    from ds_fssdp.models import GPTMoE
    from ds_fssdp.runtime.checkpoint import consolidated_state_dict
    model = GPTMoE(MODEL)
    model.load_state_dict(consolidated_state_dict(os.path.join(root, "zero3", "z3-same"), "a"), strict=True)
    saved = four[0]["zero3"]["saved"]
    params = dict(model.named_parameters())
    assert saved["dense"] and set(saved["dense"]) < set(params)
    for name, want in saved["dense"].items():
        assert torch.equal(params[name].detach(), want), name
    for layer, want in zip(model.moe_layers(), saved["experts"]):
        for name, tensor in want.items():
            assert torch.equal(getattr(layer, name).detach(), tensor), name
    for rank, r in enumerate(four):
        got = r["zero3"]
        for key in ("dense", "moments", "experts", "rows", "global_steps", "stage_steps", "lr"):
            _assert_same(got["loaded"][key], got["saved"][key], f"rank {rank} loaded {key}")
        assert got["resumed"] == got["cont"], f"rank {rank}: losses differ"
        for key in ("dense", "moments", "experts", "rows"):
            _assert_same(got["resumed_final"][key], got["final"][key], f"rank {rank} final {key}")


def test_consolidated_export_loads_into_the_unsharded_model(resharded, tmp_path):
    from ds_fssdp.models import GPTMoE
    from ds_fssdp.runtime.checkpoint import consolidated_state_dict, export_consolidated
    root, on4, _, _ = resharded
    state = consolidated_state_dict(root, "a")
    model = GPTMoE(MODEL)
    model.load_state_dict(state, strict=True)
    for layer, want in zip(model.moe_layers(), on4[0]["experts"]):
        for name, tensor in want.items():
            assert torch.equal(getattr(layer, name).detach(), tensor)
    for name, p in model.named_parameters():
        if name in on4[0]["dense"]:
            assert torch.equal(p.detach(), on4[0]["dense"][name]), name
    from safetensors.torch import load_file
    path = export_consolidated(root, str(tmp_path / "model.safetensors"), tag="a")
    assert load_file(path).keys() == state.keys()


# -- 3. atomic saves, safe loading ---------------------------------------------------------------
class _Evil:
    """Unpickling this creates a file: what a safe loader must never do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker), )


def _rewrite_manifest(root):
    from ds_fssdp.runtime.checkpoint import MANIFEST, _digest
    path = os.path.join(root, MANIFEST)
    manifest = json.load(open(path))
    for name in manifest["files"]:
        manifest["files"][name] = _digest(os.path.join(root, name), fsync=False)
    json.dump(manifest, open(path, "w"))


def _corrupt(save_dir, kind, marker):
    """Copies of checkpoint "a" with one thing wrong; returns (dir, the file the error must name)."""
    from ds_fssdp.runtime.checkpoint import DS_MODEL_STATES, MANIFEST, rank_file
    out = os.path.join(save_dir, f"bad-{kind}")
    shutil.copytree(os.path.join(save_dir, "a"), os.path.join(out, "a"))
    root = os.path.join(out, "a")
    if kind == "truncated":  # size differs from the manifest
        target = rank_file(1)
        data = open(os.path.join(root, target), "rb").read()
        open(os.path.join(root, target), "wb").write(data[:len(data) // 2])
    elif kind == "bitflip":  # same size, other bytes
        target = DS_MODEL_STATES
        data = bytearray(open(os.path.join(root, target), "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(os.path.join(root, target), "wb").write(bytes(data))
    elif kind == "truncated-unlisted":  # truncated, manifest rewritten to match: torch.load must fail clearly
        target = rank_file(1)
        data = open(os.path.join(root, target), "rb").read()
        open(os.path.join(root, target), "wb").write(data[:len(data) - 100])
        _rewrite_manifest(root)
    elif kind in ("pickle-deepspeed", "pickle-expert"):  # code in a pickle, manifest rewritten to match
        target = DS_MODEL_STATES if kind == "pickle-deepspeed" else rank_file(1)
        torch.save({"module": _Evil(marker), "layers": _Evil(marker)}, os.path.join(root, target))
        _rewrite_manifest(root)
    elif kind == "no-manifest":
        target = MANIFEST
        os.remove(os.path.join(root, target))
    return out, os.path.join(root, target)


FAULTS = ("truncated", "bitflip", "truncated-unlisted", "pickle-deepspeed", "pickle-expert", "no-manifest")


def _safety_worker(rank, world, save_dir):
    import deepspeed.comm as dist
    from ds_fssdp.runtime import checkpoint
    from ds_fssdp.runtime.checkpoint import CheckpointError
    cfg = _cfg(2, zero=0, gas=1, optimizer=ADAMW, fssdp={"reshard_interval": 1})
    out = {}
    engine, model = _engine(cfg)
    _train(engine, rank, 2, 0)
    engine.save_checkpoint(save_dir, tag="a")
    state_a = _snapshot(engine, model)
    _train(engine, rank, 1, 2)
    # A save that fails after DeepSpeed wrote its files: nothing becomes visible.
    real = checkpoint.write_expert_files

    def broken(*args, **kwargs):
        raise OSError("disk full (injected)")

    checkpoint.write_expert_files = broken
    try:
        with pytest.raises(CheckpointError) as failed:
            engine.save_checkpoint(save_dir, tag="b")
    finally:
        checkpoint.write_expert_files = real
    out["failed_save"] = str(failed.value)
    out["after_failed"] = (open(os.path.join(save_dir, "latest")).read(), sorted(os.listdir(save_dir)))
    fresh, fresh_model = _engine(cfg, seed=99)
    fresh.load_checkpoint(save_dir)
    out["loaded_after_failed"] = _snapshot(fresh, fresh_model)
    out["state_a"] = state_a
    engine.save_checkpoint(save_dir, tag="b")
    out["after_ok"] = (open(os.path.join(save_dir, "latest")).read(), sorted(os.listdir(save_dir)))
    _train(engine, rank, 1, 3)
    engine.save_checkpoint(save_dir, tag="b")  # the same tag again: replaced whole
    out["overwritten"] = _snapshot(engine, model)
    fresh.load_checkpoint(save_dir, tag="b")
    out["loaded_overwritten"] = _snapshot(fresh, fresh_model)
    # Bad files: every rank raises, naming the file.
    marker = os.path.join(save_dir, "pwned")
    errors = {}
    victim, _ = _engine(cfg, seed=5)
    for kind in FAULTS:
        if rank == 0:
            where = _corrupt(save_dir, kind, marker)
        else:
            where = None
        box = [where]
        import torch.distributed as tdist
        tdist.broadcast_object_list(box, src=0)
        bad_dir, target = box[0]
        try:
            victim.load_checkpoint(bad_dir, tag="a")
            errors[kind] = (None, target)
        except CheckpointError as err:
            errors[kind] = (str(err), target)
        dist.barrier()
    out["errors"] = errors
    out["marker"] = os.path.exists(marker)
    return out




def test_interrupted_save_leaves_previous_checkpoint(safety):
    for r in safety:
        assert "disk full (injected)" in r["failed_save"]
        latest, names = r["after_failed"]
        assert latest == "a" and "b" not in names and ".tmp-b" in names
        _assert_same({k: v for k, v in r["loaded_after_failed"].items() if k != "rng"},
                     {k: v for k, v in r["state_a"].items() if k != "rng"}, "loaded after a failed save")
        latest, names = r["after_ok"]
        assert latest == "b" and ".tmp-b" not in names and "b" in names
        _assert_same({k: v for k, v in r["loaded_overwritten"].items() if k != "rng"},
                     {k: v for k, v in r["overwritten"].items() if k != "rng"}, "overwritten tag")


@pytest.mark.parametrize("kind", FAULTS)
def test_bad_files_fail_every_rank_naming_the_file(safety, kind):
    expected = {"truncated": "truncated", "bitflip": "corrupted: sha256", "truncated-unlisted": "cannot be read",
                "pickle-deepspeed": "refused by the safe loader", "pickle-expert": "refused by the safe loader",
                "no-manifest": "is missing"}[kind]
    for rank, r in enumerate(safety):
        message, target = r["errors"][kind]
        assert message is not None, f"rank {rank} loaded a {kind} checkpoint"
        assert target in message and expected in message, (rank, message)
    assert not safety[0]["marker"], "a pickled payload ran during loading"


def test_interrupted_rename_falls_back_to_previous_copy(safety, tmp_path):
    """A save of the same tag stopped between its two renames: the moved-aside copy loads."""
    from ds_fssdp.runtime.checkpoint import consolidated_state_dict
    src = safety[0]["errors"]["bitflip"][1].split(os.sep + "bad-bitflip")[0]
    shutil.copytree(os.path.join(src, "a"), tmp_path / ".old-a")
    (tmp_path / "latest").write_text("a")
    state = consolidated_state_dict(str(tmp_path))
    assert any(k.endswith("moe.w_a") for k in state)

"""Big models in and out on 4 gloo ranks (one spawn): ``integrations.hf.from_pretrained``,
``initialize``, training and ``save_pretrained`` through the public interface, against today's path
(``convert(AutoModelForCausalLM.from_pretrained(...))``) and a single-process HF run.

Checkpoints, written by transformers itself in small shards:

* BIG: Qwen3-MoE, 4 layers of 32 experts (H 256, I 640): 240 MiB of experts in fp32, under the
  per-expert keys transformers 5 writes for its families with a conversion mapping;
* FUSED: GPT-OSS (fused, transposed, interleaved gate/up, biases: no conversion mapping; tied
  embeddings), small.

What each rank checks:

* BIG, one FSSDP group of 4, ZeRO 1: the rows it holds equal its experts in the checkpoint bitwise;
  3 SGD steps give today's path's losses and the single-process HF run's (the DP math by hand);
  ``save_pretrained`` reloads (``AutoModelForCausalLM.from_pretrained``) to the single-process run's
  trained weights and logits. Memory: the rise of peak RSS (VmHWM, reset through
  /proc/self/clear_refs) during ``from_pretrained`` + ``initialize`` stays under LOAD_BOUND and during
  ``save_pretrained`` under SAVE_BOUND (below); today's path, measured the same way (its load, and
  its export ``hf_state_dict``), exceeds them (the negative control).
* FUSED, EDP groups (group_size 2 of 4), ZeRO 1 and ZeRO 3: the rows are the checkpoint's; under
  ZeRO 3 the dense parameters are partitioned while loading (ZeRO-3 parameters before
  ``initialize``); both train to the single-process run's losses and save to its weights.
* A fresh FUSED model (``from_config``) at group size 2 of 4, ZeRO 1 and 3: each rank's drawn rows
  and the saved directory equal the single-process reference (``materialize_experts``).
* The engine checkpoints of both FUSED runs, exported offline (``hf_export``), equal what
  ``save_pretrained`` wrote.
* Bad input: a checkpoint missing an expert's key fails every rank with an error naming the key,
  and the ranks go on to a collective (none was left waiting); rows read for one group size and
  an ``initialize`` at another are refused on every rank; a full disk on one rank during
  ``save_pretrained`` fails every rank and leaves nothing.
"""
import json
import os

import pytest
import torch

from distributed import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

transformers = pytest.importorskip("transformers")

from ds_fssdp.runtime.host_memory import PeakRise  # noqa: E402
from hf_tiny import VOCAB, batch, dp_step, tiny_config  # noqa: E402

WORLD, STEPS = 4, 3
LR, CLIP = 0.2, 0.5
TOL = dict(rtol=2e-5, atol=2e-6)  # fp32 summation order, as the families' training test
MiB = 2**20
BIG = dict(model_type="qwen3_moe", hidden=256, experts=32, ffn=640, layers=4, initializer_range=0.02)
FUSED = dict(model_type="gpt_oss", hidden=32, experts=8, ffn=24, layers=2, tie_word_embeddings=True)
SHARD = "16MB"
# Stated allowances of the memory bounds (beyond dense + owned experts + one shard):
# loading converts one layer's owned experts at a time (read, mapped, flattened: 3 copies) and
# DeepSpeed builds its engine; saving maps one layer's owned experts to the HF layout (2 copies).
FIXED = 64 * MiB  # interpreter, allocator, process groups, DeepSpeed's engine and buffers


def _ds_config(*, group_size=4, zero=1):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2 * WORLD,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "fssdp": {"policy": "fssdp", "group_size": group_size, "materialization_budget": 2, "overlap_degree": 4,
                      "load_window": 1, "metrics_csv": None}}


def _checkpoint(path, spec, seed=0):
    spec = dict(spec)
    config = tiny_config(spec.pop("model_type"), vocab=VOCAB, **spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, max_shard_size=SHARD)
    return str(path)


def _data(step, rank):
    return batch(100 * step + rank, rows=2, seq=12)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    big, fused = _checkpoint(root / "big", BIG), _checkpoint(root / "fused", FUSED)
    small = _checkpoint(root / "small", dict(BIG, hidden=32, ffn=24))
    broken = _checkpoint(root / "broken", FUSED)
    from safetensors.torch import load_file, save_file
    for n in os.listdir(broken):  # GPT-OSS keeps fused keys: drop one layer's down_proj
        if n.endswith(".safetensors"):
            t = load_file(os.path.join(broken, n))
            save_file({k: v for k, v in t.items() if k != "model.layers.1.mlp.experts.down_proj"},
                      os.path.join(broken, n), metadata={"format": "pt"})
    return {"big": big, "small": small, "fused": fused, "broken": broken, "out": str(root)}


# -- memory -------------------------------------------------------------------------------------
def _sizes(path: str, rank: int, group_size: int, spec: dict) -> dict:
    """Bytes of the dense part, of this rank's own experts, of one layer of them, and of the largest
    shard, from the checkpoint's files."""
    from ds_fssdp.integrations.safetensors_io import read_header
    from ds_fssdp.planner import initial_ownership
    files = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")]
    expert = dense = 0
    for f in files:
        for key, e in read_header(f)[0].items():
            if ".experts." in key:
                expert += e.nbytes
            else:
                dense += e.nbytes
    E, L = spec["experts"], spec["layers"]
    _, owned = initial_ownership(E, group_size=group_size, group_rank=rank % group_size)
    own = expert * owned.numel() // E
    return {"dense": dense, "own": own, "layer": own // L, "shard": max(os.path.getsize(f) for f in files)}


def load_bound(s: dict) -> int:
    return s["dense"] + s["own"] + s["shard"] + 3 * s["layer"] + FIXED


def save_bound(s: dict) -> int:
    return s["dense"] + s["shard"] + 2 * s["layer"] + FIXED


# -- the ranks ----------------------------------------------------------------------------------
def _train(engine, rank):
    losses = []
    for step in range(STEPS):
        loss = engine(**_data(step, rank)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _rows_match_checkpoint(model, path) -> bool:
    """This rank's rows against its experts read independently (safetensors + transformers' own
    fused layout of the reference model)."""
    import ds_fssdp.integrations.hf as fssdp_hf
    ref = fssdp_hf.convert(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           route_initialize=False)
    full = {name: m.spec.flatten(m.export_experts()) for name, m in fssdp_hf.converted_experts(ref)}
    return all(torch.equal(m.sharded.rows.detach(), full[name][m.sharded.owned_E])
               for name, m in fssdp_hf.converted_experts(model))


def save_failing(save, owner, attr: str, error: Exception, here: bool):
    """``save()`` with ``owner.attr`` raising ``error`` on this rank if ``here``: None, or the text
    of the CheckpointError every rank gets."""
    from ds_fssdp.runtime.checkpoint.files import CheckpointError
    original = getattr(owner, attr)
    if here:
        setattr(owner, attr, lambda *a, **k: (_ for _ in ()).throw(error))
    try:
        save()
        return None
    except CheckpointError as err:
        return str(err)
    finally:
        setattr(owner, attr, original)


def worker(rank, world, paths):
    import deepspeed
    from deepspeed import comm as dist

    import ds_fssdp
    import ds_fssdp.integrations.hf as fssdp_hf
    from ds_fssdp.runtime.checkpoint.files import CheckpointError
    out = {}
    big = paths["big"]
    sizes = _sizes(big, rank, 4, BIG)
    out["sizes"] = sizes

    # Warm-up (imports, first engine): a small model of the same family through both paths.
    cfg = _ds_config()
    for load in (fssdp_hf.from_pretrained, None):
        model = (load(paths["small"], ds_config=cfg, dtype=torch.float32) if load else
                 fssdp_hf.convert(transformers.AutoModelForCausalLM.from_pretrained(paths["small"],
                                                                                    dtype=torch.float32)))
        engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
        del engine, model

    # BIG, ours: load + initialize, measured.
    with PeakRise() as load:
        model = fssdp_hf.from_pretrained(big, ds_config=cfg, dtype=torch.float32)
        engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
    out["load_rise"] = load.rise
    out["rows_match"] = _rows_match_checkpoint(model, big)
    out["owned"] = [m.sharded.owned_E.tolist() for _, m in fssdp_hf.converted_experts(model)]
    out["losses"] = _train(engine, rank)
    saved = os.path.join(paths["out"], "big_saved")
    with PeakRise() as save:
        fssdp_hf.save_pretrained(model, saved, max_shard_size=SHARD)
    out["save_rise"] = save.rise
    del engine, model
    dist.barrier()

    # BIG, today's path, measured the same way.
    with PeakRise() as load:
        model = fssdp_hf.convert(transformers.AutoModelForCausalLM.from_pretrained(big, dtype=torch.float32))
        engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
    out["today_load_rise"] = load.rise
    out["today_losses"] = _train(engine, rank)
    with PeakRise() as save:
        state = fssdp_hf.hf_state_dict(model)  # collective: what rank 0 would then save_pretrained
    out["today_save_rise"] = save.rise
    del state, engine, model
    dist.barrier()

    # FUSED: EDP groups of 2, ZeRO 1 and ZeRO 3.
    for zero in (1, 3):
        cfg = _ds_config(group_size=2, zero=zero)
        model = fssdp_hf.from_pretrained(paths["fused"], ds_config=cfg, dtype=torch.float32)
        out[f"fused{zero}_partitioned"] = sum(hasattr(p, "ds_id") for p in model.parameters())
        engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
        out[f"fused{zero}_rows_match"] = _rows_match_checkpoint(model, paths["fused"])
        out[f"fused{zero}_owned"] = [m.sharded.owned_E.tolist() for _, m in fssdp_hf.converted_experts(model)]
        out[f"fused{zero}_losses"] = _train(engine, rank)
        fssdp_hf.save_pretrained(model, os.path.join(paths["out"], f"fused{zero}_saved"))
        engine.save_checkpoint(os.path.join(paths["out"], f"fused{zero}_engine"))  # for the offline export
        if zero == 1:  # a full disk on rank 1 alone: every rank fails alike, nothing is left
            from ds_fssdp.integrations.safetensors_io import ShardFile
            out["full_disk"] = save_failing(lambda: fssdp_hf.save_pretrained(model, os.path.join(paths["out"],
                                                                                                  "full_disk")),
                                            ShardFile, "write", OSError(28, "No space left on device"), rank == 1)
        del engine, model

    # A fresh model (from_config): each rank draws its own experts at initialize; the rows are the
    # single-process reference's (materialize_experts) at group size 2 of 4 and under ZeRO 3.
    config = transformers.AutoConfig.from_pretrained(paths["fused"])
    reference = fssdp_hf.materialize_experts(fssdp_hf.from_config(config, ds_config=_ds_config(), seed=11))
    want = {n: m.spec.flatten(m.export_experts()) for n, m in fssdp_hf.converted_experts(reference)}
    for zero in (1, 3):
        model = fssdp_hf.from_config(config, ds_config=_ds_config(group_size=2, zero=zero), seed=11)
        ds_fssdp.initialize(model=model, config=_ds_config(group_size=2, zero=zero))
        out[f"fresh{zero}"] = all(torch.equal(m.sharded.rows.detach(), want[n][m.sharded.owned_E])
                                  for n, m in fssdp_hf.converted_experts(model))
        fssdp_hf.save_pretrained(model, os.path.join(paths["out"], f"fresh{zero}"))
        del model

    # Rows read for one layout, initialize asked for another: refused on every rank alike.
    model = fssdp_hf.from_pretrained(paths["small"], ds_config=_ds_config(group_size=4), dtype=torch.float32)
    try:
        ds_fssdp.initialize(model=model, config=_ds_config(group_size=2))
        out["mismatch"] = None
    except ValueError as err:
        out["mismatch"] = str(err)
    dist.barrier()

    # Bad input: every rank raises, naming the key, and none waits in a collective.
    try:
        fssdp_hf.from_pretrained(paths["broken"], ds_config=_ds_config(group_size=2))
        out["broken"] = None
    except CheckpointError as err:
        out["broken"] = str(err)
    dist.barrier()
    return out


def reference(path, *, steps=STEPS):
    """Single process, the unconverted HF model from the checkpoint, every rank's batch, DP math."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    losses = {}
    for step in range(steps):
        step_losses = dp_step(model, params, opt, [_data(step, rank) for rank in range(WORLD)], CLIP)
        losses.update({(step, rank): loss for rank, loss in enumerate(step_losses)})
    return losses, model


@pytest.fixture(scope="module")
def results(checkpoints):
    return spawn(WORLD, worker, checkpoints)


def _assert_trained_like(path_saved, ref_model, losses_by_rank, ref_losses, name):
    for rank, losses in enumerate(losses_by_rank):
        want = [ref_losses[(s, rank)] for s in range(STEPS)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), **TOL, msg=f"{name} rank {rank}")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(path_saved, dtype=torch.float32).eval()
    got, want = reloaded.state_dict(), ref_model.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=f"{name} {key}")
    ref_model.eval()
    with torch.no_grad():
        # The weights agree to fp32 summation order (above); the logits to what that moves them.
        torch.testing.assert_close(reloaded(**_data(9, 0)).logits, ref_model(**_data(9, 0)).logits, rtol=1e-4,
                                   atol=5e-5)


def test_big_model_loads_trains_and_saves_like_hf(results, checkpoints):
    ref_losses, ref_model = reference(checkpoints["big"])
    for rank, r in enumerate(results):
        assert r["rows_match"], rank
        assert r["owned"] == [list(range(8 * rank, 8 * rank + 8))] * BIG["layers"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["today_losses"]), **TOL)
    _assert_trained_like(os.path.join(checkpoints["out"], "big_saved"), ref_model, [r["losses"] for r in results],
                         ref_losses, "big")


def test_memory_of_load_and_save_is_one_rank_share(results):
    """Per rank: load (from_pretrained + initialize) under dense + own experts + one shard + the
    allowance; save under dense + one shard + the allowance (its own experts are already held).
    Today's path, the same measurement, exceeds both (it holds the whole model)."""
    for rank, r in enumerate(results):
        s = r["sizes"]
        assert s["own"] >= 50 * MiB and s["dense"] < 4 * MiB, s  # a quarter of 240 MiB of experts
        assert r["load_rise"] <= load_bound(s), (rank, r["load_rise"] / MiB, load_bound(s) / MiB)
        assert r["save_rise"] <= save_bound(s), (rank, r["save_rise"] / MiB, save_bound(s) / MiB)
        assert r["today_load_rise"] > load_bound(s), (rank, r["today_load_rise"] / MiB, load_bound(s) / MiB)
        assert r["today_save_rise"] > save_bound(s), (rank, r["today_save_rise"] / MiB, save_bound(s) / MiB)


def test_fused_family_with_edp_groups_and_zero3(results, checkpoints):
    ref_losses, ref_model = reference(checkpoints["fused"])
    for rank, r in enumerate(results):
        assert r["fused1_partitioned"] == 0 and r["fused3_partitioned"] > 0, rank
        for zero in (1, 3):
            assert r[f"fused{zero}_rows_match"], (rank, zero)
            assert r[f"fused{zero}_owned"] == [list(range(4 * (rank % 2), 4 * (rank % 2) + 4))] * FUSED["layers"]
    for zero in (1, 3):
        _assert_trained_like(os.path.join(checkpoints["out"], f"fused{zero}_saved"), ref_model,
                             [r[f"fused{zero}_losses"] for r in results], ref_losses, f"fused zero {zero}")


def test_fresh_model_draws_the_same_weights_at_any_layout(results, checkpoints):
    """from_config at group size 2 of 4 (ZeRO 1 and ZeRO 3): every rank's rows are the single-process
    reference's, and the saved directories are the reference's weights (dense part included)."""
    import ds_fssdp.integrations.hf as fssdp_hf
    config = transformers.AutoConfig.from_pretrained(checkpoints["fused"])
    reference = fssdp_hf.materialize_experts(
        fssdp_hf.from_config(config, ds_config={"fssdp": {"policy": "fssdp"}}, seed=11))
    want = fssdp_hf.hf_state_dict(reference)
    for zero in (1, 3):
        assert all(r[f"fresh{zero}"] for r in results), zero
        got = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(checkpoints["out"], f"fresh{zero}"),
                                                                 dtype=torch.float32).state_dict()
        assert set(got) == set(want)
        for key, value in want.items():
            assert torch.equal(got[key], value), (zero, key)


def test_offline_export_of_engine_checkpoints(results, checkpoints):
    """``python -m ds_fssdp.integrations.hf_export`` of the engine checkpoints (ZeRO 1: DeepSpeed's
    module state; ZeRO 3: its zero_to_fp32 consolidation) writes what save_pretrained wrote."""
    from ds_fssdp.integrations.hf_export import main
    for zero in (1, 3):
        out = os.path.join(checkpoints["out"], f"fused{zero}_exported")
        main([os.path.join(checkpoints["out"], f"fused{zero}_engine"), out, "--model", checkpoints["fused"],
              "--dtype", "float32"])
        live = os.path.join(checkpoints["out"], f"fused{zero}_saved")
        with open(os.path.join(out, "model.safetensors.index.json")) as a, \
                open(os.path.join(live, "model.safetensors.index.json")) as b:
            assert set(json.load(a)["weight_map"]) == set(json.load(b)["weight_map"])
        got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        want = transformers.AutoModelForCausalLM.from_pretrained(live, dtype=torch.float32).state_dict()
        assert set(got) == set(want)
        for key, value in want.items():
            assert torch.equal(got[key], value), (zero, key)


def test_bad_input_fails_every_rank_by_name(results, checkpoints):
    for r in results:
        assert r["broken"] is not None and "model.layers.1.mlp.experts.down_proj" in r["broken"], r["broken"]
        assert r["mismatch"] is not None and "same fssdp.group_size" in r["mismatch"], r["mismatch"]
        assert r["full_disk"] is not None and "rank(s) [1]" in r["full_disk"] and "No space left" in r["full_disk"]
    assert not any(n in ("full_disk", ".tmp-full_disk") for n in os.listdir(checkpoints["out"]))

"""Big-model load and save at layouts where experts and ranks do not divide, on 4 gloo ranks
(one spawn), through the public interface: ``from_pretrained`` -> ``initialize`` -> 3 SGD steps ->
``save_pretrained`` given the DeepSpeed engine itself, and ``model.save_pretrained`` on every rank
(transformers' method, routed), each reloaded with ``AutoModelForCausalLM.from_pretrained``.

* Qwen2-MoE with 3 experts and a shared expert (per-expert keys): rank 3 owns no expert;
* Mixtral with 5 experts (``w1/w2/w3`` per-expert keys): 2, 1, 1, 1 experts per rank.

Every rank's rows equal its experts in the checkpoint bitwise; the losses equal a single-process
HF run's (DP math by hand, SGD, clipping); the saved directories hold transformers' own key names
and reload to its trained weights and logits. A save whose dense part fails on rank 0 alone fails
every rank by name and leaves nothing. One rank under ZeRO 3: the loading info is transformers'.
"""
import json
import os

import pytest
import torch

from distributed import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

transformers = pytest.importorskip("transformers")

from test_hf_big_model import (WORLD, _assert_trained_like, _checkpoint, _ds_config, _rows_match_checkpoint,  # noqa
                               _train, reference, save_failing)

CASES = {"qwen2_moe": dict(model_type="qwen2_moe", hidden=16, experts=3, ffn=12, layers=2),
         "mixtral": dict(model_type="mixtral", hidden=16, experts=5, ffn=12, layers=2)}


def worker(rank, world, paths):
    import ds_fssdp
    import ds_fssdp.integrations.hf as fssdp_hf
    out = {}
    for name in CASES:
        cfg = _ds_config(group_size=4)
        model = fssdp_hf.from_pretrained(paths[name], ds_config=cfg, dtype=torch.float32)
        engine, *_ = ds_fssdp.initialize(model=model, config=cfg)
        out[f"{name}_owned"] = [m.sharded.owned_E.tolist() for _, m in fssdp_hf.converted_experts(model)]
        out[f"{name}_rows_match"] = _rows_match_checkpoint(model, paths[name])
        out[f"{name}_losses"] = _train(engine, rank)
        fssdp_hf.save_pretrained(engine, os.path.join(paths["out"], f"{name}_engine"))
        if name == "mixtral":  # rank 0 alone fails while it gathers the dense part: every rank fails by name
            from ds_fssdp.integrations import hf_save
            out["failed"] = save_failing(lambda: fssdp_hf.save_pretrained(model, os.path.join(paths["out"], "failed")),
                                         hf_save, "dense_state_dict", MemoryError("rank 0 out of memory"), rank == 0)
        model.save_pretrained(os.path.join(paths["out"], f"{name}_method"))
        fssdp_hf.restore_trainer_save()
        del engine, model
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    paths = {name: _checkpoint(root / name, spec) for name, spec in CASES.items()}
    paths["out"] = str(root)
    return paths


@pytest.fixture(scope="module")
def results(checkpoints):
    return spawn(WORLD, worker, checkpoints)


@pytest.mark.parametrize("name", list(CASES))
def test_uneven_and_empty_owners_load_train_and_save(results, checkpoints, name):
    E = CASES[name]["experts"]
    from ds_fssdp.planner import initial_ownership
    for rank, r in enumerate(results):
        assert r[f"{name}_rows_match"], rank
        owned = initial_ownership(E, group_size=WORLD, group_rank=rank)[1].tolist()
        assert r[f"{name}_owned"] == [owned] * CASES[name]["layers"]
    assert [len(r[f"{name}_owned"][0]) for r in results] == ([1, 1, 1, 0] if E == 3 else [2, 1, 1, 1])
    ref_losses, ref_model = reference(checkpoints[name])
    from ds_fssdp.integrations.safetensors_io import CheckpointFiles
    ckpt = checkpoints[name]
    keys = set(CheckpointFiles([os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".safetensors")]).keys())
    for how in ("engine", "method"):
        saved = os.path.join(checkpoints["out"], f"{name}_{how}")
        with open(os.path.join(saved, "model.safetensors.index.json")) as f:
            assert set(json.load(f)["weight_map"]) == keys, how  # no "module." prefix, HF's own names
        _assert_trained_like(saved, ref_model, [r[f"{name}_losses"] for r in results], ref_losses, f"{name} {how}")


def test_a_failure_on_one_rank_fails_every_rank(results, checkpoints):
    for r in results:
        assert r["failed"] is not None and "rank(s) [0]" in r["failed"] and "rank 0 out of memory" in r["failed"]
    assert not any(n in ("failed", ".tmp-failed") for n in os.listdir(checkpoints["out"]))


def info_worker(rank, world, path):
    import ds_fssdp.integrations.hf as fssdp_hf
    cfg = dict(_ds_config(group_size=1, zero=3), train_batch_size=2)  # one rank
    model, info = fssdp_hf.from_pretrained(path, ds_config=cfg, dtype=torch.float32, output_loading_info=True)
    assert any(hasattr(p, "ds_id") for p in model.parameters())  # partitioned while loading
    return info


def test_loading_info_under_zero3(tmp_path):
    """ZeRO-3 (the dense part partitioned while it loads): the loading info names what transformers'
    own names, a checkpoint key that lands nowhere included."""
    from safetensors.torch import load_file, save_file
    path = _checkpoint(tmp_path / "ckpt", CASES["mixtral"])
    for n in os.listdir(path):
        if n.endswith(".safetensors"):
            tensors = load_file(os.path.join(path, n))
            tensors["model.extra.weight"] = torch.zeros(2)
            save_file(tensors, os.path.join(path, n), metadata={"format": "pt"})
            break
    _, want = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    (info, ) = spawn(1, info_worker, path)
    assert want["unexpected_keys"] == {"model.extra.weight"} and info == want

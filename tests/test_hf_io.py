"""Big models in and out, one process: ``integrations.hf.from_pretrained`` / ``from_config`` /
``save_pretrained`` on every tested family, the owned-rows reads of any rank, and what bad input
gets (tests/test_hf_big_model.py runs them on 4 gloo ranks).

Every family's tiny model is saved by transformers itself (small shards: per-expert keys for the
families with a conversion mapping, fused for GPT-OSS, renamed fused for GraniteMoE), then:

* ``from_pretrained`` (one rank: every expert owned) returns exactly what
  ``convert(AutoModelForCausalLM.from_pretrained(...))`` returns (every tensor bitwise);
* read as rank r of an FSSDP group of 3 (``hf_load.load_as``: uneven owners), each rank holds
  exactly its owned rows of the reference, and ``SavedExperts.values`` of those rows are the
  checkpoint's own tensors under their own keys (the save direction, per rank);
* ``save_pretrained`` writes the keys transformers' ``save_pretrained`` writes (the same index
  keys), and ``AutoModelForCausalLM.from_pretrained`` reloads the same weights bitwise.
"""
import errno
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ds_fssdp.integrations.hf as fssdp_hf  # noqa: E402
from ds_fssdp.integrations import hf_load  # noqa: E402
from ds_fssdp.integrations.hf_experts import to_hf  # noqa: E402
from ds_fssdp.integrations.hf_keys import SavedExperts  # noqa: E402
from ds_fssdp.runtime.checkpoint.files import CheckpointError  # noqa: E402
from hf_tiny import FAMILIES, VOCAB, batch, saved_tensors, tiny_config, tiny_model  # noqa: E402

CFG = {"train_micro_batch_size_per_gpu": 1, "fssdp": {"policy": "fssdp"}}
F32 = dict(dtype=torch.float32)


def _saved(tmp_path, model_type, **overrides):
    path = tmp_path / f"ckpt-{model_type}"
    model = tiny_model(model_type, experts=8, **overrides)
    model.save_pretrained(path, max_shard_size="20KB")
    return path, model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_load_and_save_like_transformers(tmp_path, model_type, monkeypatch):
    monkeypatch.setattr(hf_load, "CHUNK_BYTES", 1)  # one expert at a time, both ways
    path, ref = _saved(tmp_path, model_type)
    model = fssdp_hf.from_pretrained(path, ds_config=CFG, **F32)
    plain = fssdp_hf.convert(transformers.AutoModelForCausalLM.from_pretrained(path, **F32), route_initialize=False)
    got, want = fssdp_hf.hf_state_dict(model), fssdp_hf.hf_state_dict(plain)
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch()).logits, ref.eval()(**batch()).logits, rtol=1e-5, atol=2e-5)

    # Rank r of an FSSDP group of 3 reads exactly its rows, and would write the checkpoint's own tensors.
    files = saved_tensors(path)
    ref_rows = [m.spec.flatten(m.export_experts()) for _, m in fssdp_hf.converted_experts(plain)]
    for r in range(3):
        part = hf_load.load_as(hf_load.Layout(rank=r, world=3, group_size=3, zero_stage=0), CFG, path, **F32)
        for (name, m), rows in zip(fssdp_hf.converted_experts(part), ref_rows):
            assert m.owned is not None and m.owned.owned_E.tolist() == [e for e in range(8) if e * 3 // 8 == r]
            assert torch.equal(m.owned.rows_SP, rows[m.owned.owned_E])
            saved = SavedExperts(part, name, m, torch.float32)
            pieces = saved.values(to_hf(m.spec.views(m.owned.rows_SP), m.layout), m.owned.owned_E)
            assert pieces
            for key, tensor, first in pieces:
                assert torch.equal(tensor, files[key][first:first + tensor.shape[0]] if key in saved.fused
                                   else files[key]), key

    out = tmp_path / "out"
    fssdp_hf.save_pretrained(model, out, max_shard_size="30KB")
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)["weight_map"]
    assert set(index) == set(files)  # transformers' own key names, nothing else
    assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(out))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, **F32).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in ref.state_dict().items())


def test_save_in_the_model_format(tmp_path):
    """``save_original_format=False``: the fused keys as transformers 5 holds them, as its own save writes."""
    path, ref = _saved(tmp_path, "qwen3_moe")
    model = fssdp_hf.from_pretrained(path, ds_config=CFG, **F32)
    fssdp_hf.save_pretrained(model, tmp_path / "fused", save_original_format=False)
    ref.save_pretrained(tmp_path / "hf_fused", save_original_format=False)
    assert set(saved_tensors(tmp_path / "fused")) == set(saved_tensors(tmp_path / "hf_fused"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fused", **F32).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in ref.state_dict().items())


def test_from_config_draws_each_expert_alone():
    """A fresh model: experts lazy (no storage), dense initialized by the family under the seed; the
    rows of any subset of experts are the single-process reference's (``materialize_experts``)."""
    for model_type in ("mixtral", "gpt_oss"):
        config = tiny_config(model_type, vocab=VOCAB, experts=8)
        lazy = fssdp_hf.from_config(config, ds_config=CFG, seed=7)
        ref = fssdp_hf.materialize_experts(fssdp_hf.from_config(config, ds_config=CFG, seed=7))
        other = fssdp_hf.materialize_experts(fssdp_hf.from_config(config, ds_config=CFG, seed=8))
        dense = lazy.state_dict()
        assert all(torch.equal(v, ref.state_dict()[k]) for k, v in dense.items() if not v.is_meta)
        for (_, m), (_, r), (_, o) in zip(fssdp_hf.converted_experts(lazy), fssdp_hf.converted_experts(ref),
                                          fssdp_hf.converted_experts(other)):
            assert m.lazy and not r.lazy
            rows = r.spec.flatten(r.export_experts())
            assert 0.1 < float(rows.std()) < 0.3  # the family's init (initializer_range 0.2)
            for owned in ([0, 1, 2], [7], [3, 5]):
                assert torch.equal(m.fresh_rows(torch.tensor(owned)), rows[owned])
            assert not torch.equal(rows, o.spec.flatten(o.export_experts()))
        with pytest.raises(RuntimeError, match="meta device until ds_fssdp.initialize"):
            lazy(**batch())
        assert torch.isfinite(ref(**batch()).loss)


# -- bad input ------------------------------------------------------------------------------------

def _rewrite(path, edit):
    """Apply ``edit(tensors) -> tensors`` to every shard of a saved checkpoint."""
    from safetensors.torch import load_file, save_file
    for n in os.listdir(path):
        if n.endswith(".safetensors"):
            save_file(edit(load_file(os.path.join(path, n))), os.path.join(path, n), metadata={"format": "pt"})


def test_bad_checkpoints_are_named(tmp_path, monkeypatch):
    from ds_fssdp.integrations.safetensors_io import CheckpointFiles
    path, _ = _saved(tmp_path, "mixtral")
    key = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    # A missing key, a misshapen one.
    _rewrite(path, lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(CheckpointError, match=f"no tensor '{key}'"):
        fssdp_hf.from_pretrained(path, ds_config=CFG)
    path, _ = _saved(tmp_path / "b", "mixtral")
    _rewrite(path, lambda t: {k: (v[:, :-1].contiguous() if k == key else v) for k, v in t.items()})
    with pytest.raises(CheckpointError, match=r"differ in shape|convert to shape"):
        fssdp_hf.from_pretrained(path, ds_config=CFG)
    # An expert count that is not the config's, both ways.
    path, _ = _saved(tmp_path / "c", "mixtral")
    with pytest.raises(CheckpointError, match=r"has 8 experts .* the config has 6"):
        fssdp_hf.from_pretrained(path, ds_config=CFG, num_local_experts=6)
    with pytest.raises(CheckpointError, match=r"no tensor 'model\.layers\.0\.block_sparse_moe\.experts\.8\.w1\.weight'"):
        fssdp_hf.from_pretrained(path, ds_config=CFG, num_local_experts=10)
    # A missing shard file, a truncated one.
    shard = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[1]
    data = (path / shard).read_bytes()
    (path / shard).write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=f"{shard} is truncated"):
        fssdp_hf.from_pretrained(path, ds_config=CFG)
    os.remove(path / shard)
    with pytest.raises(Exception, match=shard):
        fssdp_hf.from_pretrained(path, ds_config=CFG)
    # Fused keys (GPT-OSS): a first dimension that is not the expert count, named with its file.
    path, _ = _saved(tmp_path / "d", "gpt_oss")
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj in .*safetensors: shape \[8, .* holds 6 experts"):
        fssdp_hf.from_pretrained(path, ds_config=CFG, num_local_experts=6)
    # Nothing is read before the checks pass (CheckpointFiles.read would be the first read).
    monkeypatch.setattr(CheckpointFiles, "read", lambda *a, **k: pytest.fail("read before the checks"))
    with pytest.raises(CheckpointError):
        fssdp_hf.from_pretrained(path, ds_config=CFG, num_local_experts=6)


def test_unsupported_families_are_refused_before_reading(tmp_path, monkeypatch):
    from ds_fssdp.integrations import hf_keys
    from ds_fssdp.integrations.safetensors_io import CheckpointFiles
    monkeypatch.setattr(CheckpointFiles, "__init__", lambda *a, **k: pytest.fail("files opened"))
    llama4 = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "llama4_text", vocab_size=VOCAB, hidden_size=16, intermediate_size=24, intermediate_size_mlp=24,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4))
    llama4.save_pretrained(tmp_path / "llama4")
    with pytest.raises(fssdp_hf.UnsupportedModelError, match="model_type 'llama4_text'"):
        fssdp_hf.from_pretrained(tmp_path / "llama4", ds_config=CFG)
    monkeypatch.undo()
    # A conversion that does not act on each expert alone is refused by name (op and tensor).
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter
    path, _ = _saved(tmp_path, "qwen3_moe")
    model = fssdp_hf.convert(transformers.AutoModelForCausalLM.from_pretrained(path), route_initialize=False)
    files = CheckpointFiles([str(path / n) for n in os.listdir(path) if n.endswith(".safetensors")])
    mapping = [WeightConverter("mlp.experts.*.gate_proj.weight", "mlp.experts.gate_up_proj",
                               operations=[MergeModulelist(dim=0), Transpose(dim0=0, dim1=1)])]
    with pytest.raises(hf_keys.UnmappableExpertsError, match=r"experts\.gate_up_proj .*Transpose\(dim0=0, dim1=1\)"):
        hf_keys.plan_experts(model, fssdp_hf.converted_experts(model), files, mapping, model_type="qwen3_moe")


def test_save_refuses_a_used_directory_and_fails_atomically(tmp_path, monkeypatch):
    from ds_fssdp.integrations.safetensors_io import ShardFile
    path, _ = _saved(tmp_path, "gpt_oss")
    model = fssdp_hf.from_pretrained(path, ds_config=CFG, **F32)
    used = tmp_path / "used"
    used.mkdir()
    (used / "config.json").write_text("{}")  # another model's file
    with pytest.raises(CheckpointError, match=r"already holds a model's files \(config\.json\)"):
        fssdp_hf.save_pretrained(model, used)
    assert os.listdir(used) == ["config.json"]
    with pytest.raises(ValueError, match="push_to_hub=True is not supported"):
        fssdp_hf.save_pretrained(model, tmp_path / "x", push_to_hub=True)

    def full_disk(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    monkeypatch.setattr(ShardFile, "write", full_disk)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="No space left on device"):
        fssdp_hf.save_pretrained(model, out)
    assert not out.exists() and not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))
    (tmp_path / "empty").mkdir()  # an empty directory is taken
    monkeypatch.undo()
    fssdp_hf.save_pretrained(model, tmp_path / "empty")
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "empty")


def test_trainer_save_model_is_routed_for_converted_models():
    fssdp_hf.restore_trainer_save()
    original = transformers.Trainer.save_model
    fssdp_hf.convert(tiny_model("olmoe"))
    try:
        assert transformers.Trainer.save_model is not original
        assert transformers.Trainer.save_model._fssdp_original is original
        fssdp_hf.route_trainer_save()  # idempotent
        assert transformers.Trainer.save_model._fssdp_original is original
    finally:
        fssdp_hf.restore_trainer_save()
        fssdp_hf.restore_deepspeed_initialize()
    assert transformers.Trainer.save_model is original

"""``integrations.hf.from_pretrained`` / ``save_pretrained`` through the interface a user has, one
process: the HF kwargs (``output_loading_info``, ``dtype``, ``revision``; the refused ones by name),
a config without FSSDP, the transformers version the loader's hook needs, experts modules that
compute more than their expert MLPs, owned experts frozen by ``requires_grad_`` or PEFT, and saves
through ``model.save_pretrained``, a DeepSpeed engine and the Trainer's ``output_dir``.
"""
import errno
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ds_fssdp.integrations.hf as fssdp_hf  # noqa: E402
from ds_fssdp.config import FSSDPConfigError  # noqa: E402
from ds_fssdp.integrations import hf_load, hf_save  # noqa: E402
from ds_fssdp.integrations.safetensors_io import CheckpointFiles  # noqa: E402
from ds_fssdp.runtime.checkpoint.files import CheckpointError  # noqa: E402
from hf_tiny import VOCAB, tiny_config, tiny_model  # noqa: E402

CFG = {"train_micro_batch_size_per_gpu": 1, "fssdp": {"policy": "fssdp"}}
F32 = dict(dtype=torch.float32)


@pytest.fixture(autouse=True)
def _restore():
    yield
    fssdp_hf.restore_trainer_save()
    fssdp_hf.restore_deepspeed_initialize()


def _saved(tmp_path, model_type="qwen3_moe", experts=5, **overrides):
    path = tmp_path / f"ckpt-{model_type}"
    model = tiny_model(model_type, experts=experts, **overrides)
    model.save_pretrained(path, max_shard_size="20KB")
    return path, model


def _plain(path, **kw):
    return fssdp_hf.convert(transformers.AutoModelForCausalLM.from_pretrained(path, **kw), route_initialize=False)


def _rows(model) -> list:
    return [m.spec.flatten(m.export_experts()) for _, m in fssdp_hf.converted_experts(model)]


def test_hf_kwargs_pass_through_or_are_refused_by_name(tmp_path, monkeypatch):
    path, _ = _saved(tmp_path)
    model, info = fssdp_hf.from_pretrained(path, ds_config=CFG, output_loading_info=True, **F32)
    _, want = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **F32)
    assert fssdp_hf.converted_experts(model) and info == want
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # dtype, revision, trust_remote_code and attn_implementation: the rows are transformers' own bf16 load, bitwise.
    bf16 = fssdp_hf.from_pretrained(path, ds_config=CFG, dtype=torch.bfloat16, revision="main",
                                    trust_remote_code=True, attn_implementation="eager")
    assert bf16.config._attn_implementation == "eager"
    ref = _plain(path, dtype=torch.bfloat16)
    for got, want in zip(_rows(bf16), _rows(ref)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # Rank 1 of 2 reads bf16 rows too.
    part = hf_load.load_as(hf_load.Layout(rank=1, world=2, group_size=2, zero_stage=0), CFG, path,
                           dtype=torch.bfloat16)
    for (_, m), want in zip(fssdp_hf.converted_experts(part), _rows(ref)):
        assert m.owned.rows_SP.dtype == torch.bfloat16 and torch.equal(m.owned.rows_SP, want[m.owned.owned_E])
    monkeypatch.setattr(hf_load, "layout_of", lambda *a, **k: pytest.fail("started before the kwargs were checked"))
    for key, value in (("device_map", "auto"), ("tp_plan", "auto"), ("device_mesh", object()), ("gguf_file", "x.gguf"),
                       ("state_dict", {})):
        with pytest.raises(ValueError, match=f"{key}=.* is not supported"):
            fssdp_hf.from_pretrained(path, ds_config=CFG, **{key: value})


def test_a_config_without_fssdp_is_refused_by_name(tmp_path):
    path, _ = _saved(tmp_path)
    plain = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(FSSDPConfigError, match='has no "fssdp" section'):
        fssdp_hf.from_pretrained(path, ds_config=plain)
    with pytest.raises(FSSDPConfigError, match="sets fssdp.enabled false"):
        fssdp_hf.from_pretrained(path, ds_config=dict(plain, fssdp={"enabled": False}))
    with pytest.raises(FSSDPConfigError, match='has no "fssdp" section'):
        fssdp_hf.from_config(tiny_config("mixtral", vocab=VOCAB), ds_config=plain)


def test_the_transformers_version_is_checked(tmp_path, monkeypatch):
    from transformers.modeling_utils import PreTrainedModel
    path, _ = _saved(tmp_path)
    warned = []
    monkeypatch.setattr(hf_load.logger, "warning", warned.append)
    from packaging.version import Version
    monkeypatch.setattr(hf_load, "installed_transformers", lambda: Version("5.99.0"))
    fssdp_hf.from_pretrained(path, ds_config=CFG)  # the hook's shape holds: a warning naming the version
    assert len(warned) == 1 and "transformers 5.99.0" in warned[0] and "outside the tested range" in warned[0]
    fssdp_hf.from_pretrained(path, ds_config=CFG)
    assert len(warned) == 1  # once per version
    monkeypatch.setattr(hf_load, "installed_transformers",
                        lambda: Version(hf_load.TESTED_TRANSFORMERS.split(",")[0].lstrip(">=")))
    fssdp_hf.from_pretrained(path, ds_config=CFG)
    assert len(warned) == 1

    def other_shape(model, checkpoint_files, load_config, state_dict=None):
        pytest.fail("called")

    monkeypatch.setattr(PreTrainedModel, "_load_pretrained_model", staticmethod(other_shape))
    monkeypatch.setattr(CheckpointFiles, "read", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(RuntimeError, match=r"transformers 5\.24 .*takes as \(model, checkpoint_files, "):
        fssdp_hf.from_pretrained(path, ds_config=CFG)


def test_experts_that_compute_more_are_refused_by_name(tmp_path, monkeypatch):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class ScaledExperts(MixtralExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights) * 1.5

    class SizedExperts(MixtralExperts):  # the same math, its tokens shaped by its config: converts
        def forward(self, hidden_states, top_k_index, top_k_weights):
            hidden_states = hidden_states.reshape(-1, self.config.hidden_size)
            return super().forward(hidden_states, top_k_index, top_k_weights)

    fssdp_hf.convert(tiny_model("mixtral"), route_initialize=False)  # the family itself converts
    model = tiny_model("mixtral")
    for layer in model.model.layers:
        layer.mlp.experts.__class__ = SizedExperts
    fssdp_hf.convert(model, route_initialize=False)
    model = tiny_model("mixtral")
    for layer in model.model.layers:
        layer.mlp.experts.__class__ = ScaledExperts
    with pytest.raises(fssdp_hf.UnsupportedModelError, match=r"ScaledExperts\.forward\) computes something other "
                                                             r"than the gate-weighted sum"):
        fssdp_hf.convert(model, route_initialize=False)
    model = tiny_model("mixtral")  # a learned per-expert scale the forward would use
    model.model.layers[1].mlp.experts.register_parameter("post_scale", torch.nn.Parameter(torch.ones(4, 16)))
    with pytest.raises(fssdp_hf.UnsupportedModelError, match=r"layers\.1\.mlp\.experts .*holds \['post_scale'\]"):
        fssdp_hf.convert(model, route_initialize=False)
    # From a checkpoint: refused on the meta skeleton, before any expert is read.
    path, _ = _saved(tmp_path, "mixtral")
    original = MixtralExperts.forward
    monkeypatch.setattr(MixtralExperts, "forward", lambda self, *a: original(self, *a) + 1.0)
    monkeypatch.setattr(CheckpointFiles, "__init__", lambda *a, **k: pytest.fail("files opened"))
    with pytest.raises(fssdp_hf.UnsupportedModelError, match="model_type 'mixtral'.*gate-weighted"):
        fssdp_hf.from_pretrained(path, ds_config=CFG)
    if "ergo" in transformers.models.auto.configuration_auto.CONFIG_MAPPING:  # a family that does (post-expert norms)
        config = transformers.AutoConfig.for_model("ergo", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                                   num_experts=4, moe_intermediate_size=8,
                                                   first_dense_intermediate_size=8, mlp_layer_types=["dense", "sparse"],
                                                   layer_types=["sliding_attention", "full_attention"])
        with torch.device("meta"):
            ergo = transformers.AutoModelForCausalLM.from_config(config)
        with pytest.raises(fssdp_hf.UnsupportedModelError, match=r"'ergo'.*post_expert_norm\.weight"):
            fssdp_hf.convert(ergo, route_initialize=False)


def test_owned_experts_follow_requires_grad_and_peft(tmp_path):
    path, _ = _saved(tmp_path)
    layout = hf_load.Layout(rank=0, world=2, group_size=2, zero_stage=0)
    part = hf_load.load_as(layout, CFG, path, **F32)
    modules = [m for _, m in fssdp_hf.converted_experts(part)]
    assert all(m.owned is not None and m.trainable for m in modules)
    part.model.layers[0].mlp.experts.requires_grad_(False)
    assert [m.trainable for m in modules] == [False, True]
    # PEFT freezes the base model: the owned experts too; the adapters train and save as PEFT saves them.
    peft = pytest.importorskip("peft")
    from lora_tiny import lora_config
    part = hf_load.load_as(layout, CFG, path, **F32)
    lora = peft.get_peft_model(part, lora_config(rank_pattern={}))
    assert not any(m.trainable for _, m in fssdp_hf.converted_experts(lora))
    assert {n for n, p in lora.named_parameters() if p.requires_grad} == \
        {n for n, _ in lora.named_parameters() if "lora_" in n}
    fssdp_hf.save_pretrained(lora, tmp_path / "adapters")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapters"))


class _Engine:
    """A DeepSpeed engine without the distributed start: the class, and its model as ``module``."""

    def __new__(cls, model):
        from deepspeed.runtime.engine import DeepSpeedEngine
        engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
        torch.nn.Module.__init__(engine)
        engine.module = model
        return engine


def _index_keys(out) -> set:
    import json
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        return set(json.load(f)["weight_map"])


def test_saves_through_the_model_an_engine_and_the_trainer_output_dir(tmp_path, monkeypatch):
    path, ref = _saved(tmp_path)
    want = ref.state_dict()
    hf_keys = _index_keys_of_hf(ref, tmp_path / "hf")

    def reloads(out):
        got = transformers.AutoModelForCausalLM.from_pretrained(out, **F32).state_dict()
        return set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())

    model = fssdp_hf.from_pretrained(path, ds_config=CFG, **F32)
    model.save_pretrained(tmp_path / "by_model")  # transformers' method on a converted model
    assert _index_keys(tmp_path / "by_model") == hf_keys and reloads(tmp_path / "by_model")
    fssdp_hf.save_pretrained(_Engine(model), tmp_path / "by_engine")  # keys without the engine's "module."
    assert _index_keys(tmp_path / "by_engine") == hf_keys and reloads(tmp_path / "by_engine")
    # The Trainer's output_dir: checkpoint-N folders and logs beside, no model files.
    out = tmp_path / "output_dir"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "model.safetensors.index.json").write_text("{}")
    (out / "runs").mkdir()
    (out / "README.md").write_text("notes")
    before = sorted(os.listdir(out))

    def broken_replace(src, dst, _real=os.replace):
        if dst.endswith("model.safetensors.index.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)
        return _real(src, dst)

    monkeypatch.setattr(hf_save.os, "replace", broken_replace)  # fails while moving in: the moved files go
    with pytest.raises(CheckpointError, match="No space left on device"):
        model.save_pretrained(out)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == before and not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))
    model.save_pretrained(out)
    assert reloads(out) and (out / "checkpoint-2" / "model.safetensors.index.json").read_text() == "{}"
    with pytest.raises(CheckpointError, match=r"already holds a model's files \(config\.json"):
        fssdp_hf.save_pretrained(model, out)
    # The whole HF state dict given: transformers' own save, as before.
    model.save_pretrained(tmp_path / "given", state_dict=fssdp_hf.hf_state_dict(model))
    assert reloads(tmp_path / "given")
    # The Trainer's save_model (routed; here on a stand-in Trainer) overwrites, as its own does:
    # the previous model's files go, stale shards included, the rest stays.
    from types import SimpleNamespace
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    with torch.no_grad():
        for _, m in fssdp_hf.converted_experts(model):
            m.w_down.mul_(2)
    trainer = SimpleNamespace(model=model, processing_class=None,
                              args=SimpleNamespace(output_dir=str(out), should_save=True, push_to_hub=False))
    transformers.Trainer.save_model(trainer)
    assert "model-00009-of-00009.safetensors" not in os.listdir(out) and "training_args.bin" in os.listdir(out)
    assert (out / "checkpoint-2" / "model.safetensors.index.json").read_text() == "{}"
    doubled = transformers.AutoModelForCausalLM.from_pretrained(out, **F32)
    for (_, m), (_, d) in zip(fssdp_hf.converted_experts(model),
                              fssdp_hf.converted_experts(fssdp_hf.convert(doubled, route_initialize=False))):
        assert torch.equal(m.w_down, d.w_down)


def _index_keys_of_hf(ref, out) -> set:
    ref.save_pretrained(out, max_shard_size="20KB")
    return _index_keys(out)

"""Every MoE family of the installed transformers with an experts module on its experts contract,
through ``integrations.hf.from_pretrained`` / ``save_pretrained`` (one process), at an odd expert
count (5 experts: 3 and 2 on the ranks of a group of 2).

Each family's tiny model (its default config shrunk generically: :func:`tiny_any`) is saved by
transformers itself in small shards (per-expert keys where the family has a conversion mapping:
Mixtral's ``w1/w2/w3``, DeepSeek's and Qwen's ``gate_proj/up_proj/down_proj``; fused keys with
biases for GPT-OSS; renamed fused keys for GraniteMoE; hybrids with Mamba or linear attention:
Jamba, Nemotron-H, Qwen3-Next, Kimi-Linear), then:

* ``from_pretrained`` on one rank equals ``convert(AutoModelForCausalLM.from_pretrained(...))``
  bitwise, tensor by tensor;
* as rank 0 and rank 1 of a group of 2 (``hf_load.load_as``) each holds exactly its rows of it;
* ``save_pretrained`` writes the keys transformers' own save writes, and they reload bitwise.

A family the installed transformers lacks is skipped, naming it; one that computes more than its
expert MLPs is refused (tests/test_hf_interface.py).
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ds_fssdp.integrations.hf as fssdp_hf  # noqa: E402
from ds_fssdp.integrations import hf_load  # noqa: E402
from hf_tiny import saved_tensors  # noqa: E402

pytestmark = pytest.mark.slow
CFG = {"train_micro_batch_size_per_gpu": 1, "fssdp": {"policy": "fssdp"}}
F32 = dict(dtype=torch.float32)
EXPERTS = 5
# Checked with transformers 5.25 (its families on the experts contract whose default config the
# shrinking below builds; the 13 of integrations/hf_tiny.py are among them).
FAMILIES = ("afmoe", "aria_text", "axk1", "axk2", "cohere2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v4",
            "ernie4_5_moe", "exaone_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite", "gpt_oss", "granitemoe",
            "granitemoe_swa", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "inkling_text", "jamba", "kimi_linear",
            "kolibri1", "laguna", "lara_mini", "longcat_flash", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax",
            "minimax_m2", "minimax_m3_vl_text", "mixtral", "nemotron_h", "olmoe", "param2moe", "phimoe", "qwen2_moe",
            "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text", "sarvam_mla", "sarvam_moe", "solar_open")
_SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
              shared_expert_intermediate_size=20, bos_token_id=2, eos_token_id=1, pad_token_id=0,
              tie_word_embeddings=False, first_k_dense_replace=0, num_experts_per_tok=2, initializer_range=0.2)
_EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_routed_experts")
_PER_LAYER = ("layer_types", "layers_block_type", "mlp_layer_types", "hybrid_override_pattern")


def tiny_any(model_type: str):
    """The family's default config with its sizes shrunk (the keys it has), EXPERTS experts."""
    text = transformers.AutoConfig.for_model(model_type)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    kw = {k: v for k, v in _SMALL.items() if hasattr(text, k)}
    kw.update({k: EXPERTS for k in _EXPERT_COUNTS if isinstance(getattr(text, k, None), int)})
    kw.update({k: 1 for k in ("n_group", "topk_group") if getattr(text, k, None) is not None})
    kw.update({k: v[:2] for k, v in vars(text).items()
               if isinstance(v, list) and len(v) > 2 and k.endswith(_PER_LAYER)})
    return transformers.AutoConfig.for_model(model_type, **kw)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_loads_and_saves_bitwise(tmp_path, model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model_type {model_type!r}")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(tiny_any(model_type))
    path = tmp_path / "ckpt"
    ref.save_pretrained(path, max_shard_size="20KB")
    model = fssdp_hf.from_pretrained(path, ds_config=CFG, **F32)
    plain = fssdp_hf.convert(transformers.AutoModelForCausalLM.from_pretrained(path, **F32), route_initialize=False)
    got, want = fssdp_hf.hf_state_dict(model), fssdp_hf.hf_state_dict(plain)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    modules = fssdp_hf.converted_experts(plain)
    assert modules and all(m.num_experts == EXPERTS for _, m in modules)
    rows = [m.spec.flatten(m.export_experts()) for _, m in modules]
    for rank, count in ((0, 3), (1, 2)):
        part = hf_load.load_as(hf_load.Layout(rank=rank, world=2, group_size=2, zero_stage=0), CFG, path, **F32)
        for (_, m), full in zip(fssdp_hf.converted_experts(part), rows):
            assert m.owned.owned_E.numel() == count and torch.equal(m.owned.rows_SP, full[m.owned.owned_E])
    fssdp_hf.save_pretrained(model, tmp_path / "out", max_shard_size="30KB")
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        assert set(json.load(f)["weight_map"]) == set(saved_tensors(path))  # transformers' own key names
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", **F32).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in ref.state_dict().items())
    fssdp_hf.restore_trainer_save()
    fssdp_hf.restore_deepspeed_initialize()

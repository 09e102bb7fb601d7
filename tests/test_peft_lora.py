"""PEFT LoRA on converted experts, one process: the converted model (PEFT before or after
``convert``) computes what plain HF + PEFT computes (logits, loss, every trainable gradient), on
families with each expert layout (concatenated / interleaved gate-up, transposed, biases); the
adapter saves and reloads into plain HF + PEFT; refusals name the option."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import ds_fssdp.integrations.hf as fssdp_hf  # noqa: E402
from hf_tiny import batch, tiny_model  # noqa: E402
from lora_tiny import EXPERT_TARGETS, lora_model  # noqa: E402

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral")
ATOL = 2e-5  # fp32 logits; the reference folds the delta into W, FSSDP adds x A^T B^T


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_converted_lora_matches_peft(model_type, order):
    ref = lora_model(model_type).eval()
    model = lora_model(model_type, order=order).eval()
    assert len(fssdp_hf.converted_experts(model)) == 2
    # rank_pattern: layer 1's down_proj has rank 3 (lora_A is Linear(I, r * E)).
    assert model.base_model.model.model.layers[1].mlp.experts.lora_A["default"].weight.shape[0] == 3 * 4
    assert not any(n.endswith(".gate_up_proj") and p.numel() for n, p in model.named_parameters())
    data = batch()
    out_ref, out = ref(**data), model(**data)
    torch.testing.assert_close(out.logits, out_ref.logits, atol=ATOL, rtol=1e-5)
    out_ref.loss.backward()
    out.loss.backward()
    ref_grads, grads = _grads(ref), _grads(model)
    assert set(grads) == set(ref_grads) and any("experts.base_layer.lora_B" in n for n in grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)
    # Adapters off: the base model's function.
    with model.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(model(**data).logits, tiny_model(model_type).eval()(**data).logits, atol=ATOL,
                                   rtol=1e-5)


def test_rslora_and_alpha_pattern_scale_like_peft():
    options = dict(use_rslora=True, alpha_pattern={"layers.0.mlp.experts.gate_up_proj": 7})
    ref, model = lora_model("qwen3_moe", **options).eval(), lora_model("qwen3_moe", order="before", **options).eval()
    scalings = {w.scaling["default"] for w in model.modules() if type(w).__name__ == "FSSDPParamWrapper"}
    assert len(scalings) > 2  # alpha / sqrt(r) with two ranks and two alphas
    with torch.no_grad():
        torch.testing.assert_close(model(**batch()).logits, ref(**batch()).logits, atol=ATOL, rtol=1e-5)


def test_adapter_saved_while_converted_loads_into_plain_peft(tmp_path):
    model = lora_model("deepseek_v3", order="before").eval()
    model.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(tiny_model("deepseek_v3"), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch()).logits, model(**batch()).logits, atol=ATOL, rtol=1e-5)
        with pytest.raises(ValueError, match="unconvert"):
            model.merge_and_unload()
        fssdp_hf.unconvert(model)
        expected = lora_model("deepseek_v3").eval()(**batch()).logits
        torch.testing.assert_close(model(**batch()).logits, expected, atol=ATOL, rtol=1e-5)
        merged = model.merge_and_unload()
        assert merged.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 24, 16)  # the HF module, LoRA merged
        torch.testing.assert_close(merged(**batch()).logits, expected, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("option, value, order", [("use_dora", True, "before"), ("use_dora", True, "after"),
                                                  ("lora_dropout", 0.1, "after"), ("lora_bias", True, "after")])
def test_peft_refuses_what_it_cannot_do_on_expert_tensors(option, value, order):
    """PEFT's own refusal, also when the wrapped module is a converted one (order "after")."""
    with pytest.raises(ValueError, match=option):
        lora_model("qwen3_moe", order=order, target_modules=None, **{option: value})


@pytest.mark.parametrize("order", ["before", "after"])
def test_lora_on_expert_biases_is_refused_by_name(order):
    targets = EXPERT_TARGETS + ["mlp.experts.gate_up_proj_bias"]
    with pytest.raises(ValueError, match="target_parameters names 'gate_up_proj_bias'"):
        model = lora_model("gpt_oss", order=order, target_parameters=targets)
        model(**batch())  # PEFT after convert: adopted at the MoE block's first forward


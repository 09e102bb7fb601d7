"""ds_fssdp.integrations.hf: in-place conversion of tiny HF MoE models (one process, fp32).

Every supported family is built from a config (no download) with weights large enough that the
routing is far from uniform, converted, and compared with an untouched deep copy: logits, loss
(with the router aux loss the model's own code adds), router logits and every gradient. The
tolerance is fp32 summation order: the expert outputs are the same products summed in another
order (HF adds experts in expert order, FSSDP combines top-k in k order).
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ds_fssdp.integrations.hf as fssdp_hf  # noqa: E402
from ds_fssdp import FSSDPMoE  # noqa: E402
from ds_fssdp.config import FSSDPConfigError  # noqa: E402
from ds_fssdp.integrations.hf_blocks import FSSDPSparseMoeBlock, to_hf_experts  # noqa: E402

VOCAB = 64
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ATOL = 2e-5  # fp32, logits of magnitude ~1-10 after two layers


def tiny_config(model_type: str, **overrides):
    """A 2-layer model with 4 experts, top-2, from a config; special ids inside the tiny vocab."""
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.1,
                  initializer_range=0.2, bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    if model_type == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **common)
    elif model_type == "qwen2_moe":
        # norm_topk_prob False (the Qwen default): raw softmax weights; a shared expert behind a sigmoid gate.
        cfg = transformers.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=12,
                                          shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2,
                                          norm_topk_prob=False, **common)
    elif model_type == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=12, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True, head_dim=8, **common)
    elif model_type == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=12, num_experts=4, num_experts_per_tok=2,
                                       norm_topk_prob=False, **common)
    else:
        raise ValueError(model_type)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))


def batch(seed: int = 1, *, rows: int = 3, seq: int = 12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on one row: the aux loss is masked too
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def hf_grads(model) -> dict:
    """Gradients by HF parameter name; a converted model's expert gradients mapped to HF layout."""
    grads = {}
    for name, p in model.named_parameters():
        if ".moe.w_" not in name:
            grads[name] = p.grad
    for name, block in fssdp_hf.converted_blocks(model):
        mapped = to_hf_experts({n: getattr(block.moe, n).grad for n in block.moe.spec.names})
        grads.update({f"{name}.experts.{k}": v for k, v in mapped.items()})
    return grads


@pytest.mark.parametrize("model_type", FAMILIES)
def test_converted_model_matches_original(model_type):
    ref = tiny_model(model_type)
    model = fssdp_hf.convert(copy.deepcopy(ref), route_initialize=False)
    blocks = fssdp_hf.converted_blocks(model)
    assert len(blocks) == 2 and all(isinstance(b.moe, FSSDPMoE) for _, b in blocks)
    assert not any(".experts." in n for n, _ in model.named_parameters())
    if model_type == "qwen2_moe":
        assert all(b.shared_expert is not None for _, b in blocks)

    data = batch()
    out_ref, out = ref(**data), model(**data)
    assert out_ref.aux_loss is not None and out.aux_loss is not None
    torch.testing.assert_close(out.logits, out_ref.logits, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.loss, out_ref.loss, atol=1e-6, rtol=1e-6)
    assert len(out.router_logits) == len(out_ref.router_logits) == 2
    for a, b in zip(out.router_logits, out_ref.router_logits):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # The aux loss is part of the loss (coefficient 0.1): check it is really added.
    assert abs(float(out.aux_loss.detach())) > 1.0

    out_ref.loss.backward()
    out.loss.backward()
    ref_grads, grads = dict((n, p.grad) for n, p in ref.named_parameters()), hf_grads(model)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert g is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)

    # The HF-layout state dict is exactly the original's.
    state, ref_state = fssdp_hf.hf_state_dict(model), ref.state_dict()
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key


def test_mixtral_router_jitter_in_training():
    ref = tiny_model("mixtral", router_jitter_noise=0.1)
    model = fssdp_hf.convert(copy.deepcopy(ref), route_initialize=False)
    ref.train()
    model.train()
    data = batch()
    torch.manual_seed(7)
    out_ref = ref(**data)
    torch.manual_seed(7)
    out = model(**data)
    torch.testing.assert_close(out.logits, out_ref.logits, atol=ATOL, rtol=1e-5)
    torch.manual_seed(8)
    assert not torch.allclose(model(**data).logits, out.logits), "jitter had no effect"


def test_router_logits_recorded_when_hooks_predate_conversion():
    ref = tiny_model("qwen3_moe")
    model = copy.deepcopy(ref)
    model(**batch(2))  # installs HF's output-capturing hooks on the routers before converting
    fssdp_hf.convert(model, route_initialize=False)
    out, out_ref = model(**batch()), ref(**batch())
    assert len(out.router_logits) == 2
    torch.testing.assert_close(out.loss, out_ref.loss, atol=1e-6, rtol=1e-6)


def _train_converted(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        loss = model(**batch(10 + step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_save_pretrained_round_trip(model_type, tmp_path):
    model = fssdp_hf.convert(tiny_model(model_type), route_initialize=False)
    _train_converted(model)
    model.eval()
    with torch.no_grad():
        expected = model(**batch()).logits

    # Mid-training: the HF-layout state dict of the still converted model.
    model.save_pretrained(tmp_path / "state_dict", state_dict=fssdp_hf.hf_state_dict(model))
    # End of training: the original blocks back in place.
    fssdp_hf.unconvert(model)
    assert not fssdp_hf.converted_blocks(model)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(**batch()).logits, expected, atol=ATOL, rtol=1e-5)
    model.save_pretrained(tmp_path / "unconverted")

    for sub in ("state_dict", "unconverted"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / sub).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(**batch()).logits, expected, atol=ATOL, rtol=1e-5, msg=sub)
        # And a reloaded model converts again to the same function.
        reconverted = fssdp_hf.convert(loaded, route_initialize=False)
        with torch.no_grad():
            torch.testing.assert_close(reconverted(**batch()).logits, expected, atol=ATOL, rtol=1e-5, msg=sub)


def test_unsupported_models_are_refused():
    torch.manual_seed(0)
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(fssdp_hf.UnsupportedModelError, match=r"LlamaForCausalLM \(model_type 'llama'\).*mixtral"):
        fssdp_hf.convert(llama)
    with pytest.raises(ValueError, match=r"activation.*'gelu'"):
        fssdp_hf.convert(tiny_model("mixtral", hidden_act="gelu"))
    model = fssdp_hf.convert(tiny_model("olmoe"), route_initialize=False)
    with pytest.raises(ValueError, match="already converted"):
        fssdp_hf.convert(model)


def test_gradient_checkpointing_is_refused():
    model = fssdp_hf.convert(tiny_model("mixtral"), route_initialize=False)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    with pytest.raises(FSSDPConfigError, match="gradient checkpointing"):
        fssdp_hf.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1})


def test_convert_routes_deepspeed_initialize():
    import deepspeed

    from ds_fssdp.runtime.engine import _deepspeed_initialize
    try:
        fssdp_hf.convert(tiny_model("olmoe"))
        assert deepspeed.initialize is fssdp_hf.initialize
    finally:
        fssdp_hf.restore_deepspeed_initialize()
    assert deepspeed.initialize is _deepspeed_initialize
    assert isinstance(fssdp_hf.converted_blocks(fssdp_hf.convert(tiny_model("olmoe"), route_initialize=False))[0][1],
                      FSSDPSparseMoeBlock)

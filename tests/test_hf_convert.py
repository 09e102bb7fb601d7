"""ds_fssdp.integrations.hf: in-place conversion of tiny HF MoE models (one process, fp32).

Every tested family (``hf_tiny.FAMILIES``) is built from a config (no download) with weights large
enough that the routing is far from uniform, converted, and compared with an untouched deep copy
in eval mode (PhiMoE's router samples in training): logits, loss (with the router aux loss the
model's own code adds), router logits and every gradient. The tolerance is fp32 summation order:
the expert outputs are the same products summed in another order (HF adds experts in expert
order, FSSDP combines top-k in k order).
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ds_fssdp.integrations.hf as fssdp_hf  # noqa: E402
from ds_fssdp.integrations.hf_experts import FSSDPHFExperts, to_hf  # noqa: E402
from hf_tiny import BIASED, FAMILIES, VOCAB, batch, tiny_model  # noqa: E402

ATOL = 2e-5  # fp32, logits of magnitude ~1-10 after two layers


def hf_grads(model) -> dict:
    """Gradients by HF parameter name; a converted model's expert gradients mapped to HF layout."""
    converted = fssdp_hf.converted_experts(model)
    ours = {f"{name}.{n}" for name, m in converted for n in m.spec.names}
    grads = {name: p.grad for name, p in model.named_parameters() if name not in ours}
    for name, m in converted:
        mapped = to_hf({n: getattr(m, n).grad for n in m.spec.names}, m.layout)
        grads.update({f"{name}.{k}": v for k, v in mapped.items()})
    return grads


def test_router_bias_binding_follows_a_move_of_the_model():
    """The bias rule moves the tensor the router reads, also after ``.to()`` replaced it (as a move
    to the GPU does): the binding is by module and name, not by the tensor seen at conversion."""
    model = fssdp_hf.convert(tiny_model("deepseek_v3"), route_initialize=False).double()
    (name, module), = [c for c in fssdp_hf.converted_experts(model)][:1]
    router = model.get_submodule(name.rpartition(".")[0]).gate
    assert module.router_bias is router.e_score_correction_bias
    assert module.router_bias.dtype == torch.float64
    before = router.e_score_correction_bias.clone()
    module.router_bias_update_rate = 0.5
    module.observe_load(torch.arange(module.num_experts))
    module.update_routing_bias()
    assert not torch.equal(router.e_score_correction_bias, before)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_converted_model_matches_original(model_type):
    ref = tiny_model(model_type).eval()
    model = fssdp_hf.convert(copy.deepcopy(ref), route_initialize=False).eval()
    converted = fssdp_hf.converted_experts(model)
    assert len(converted) == 2 and all(isinstance(m, FSSDPHFExperts) for _, m in converted)
    assert (model_type in BIASED) == all(m.router_bias is not None for _, m in converted)
    hf_names = {n for n, _ in ref.named_parameters()}

    data = batch()
    out_ref, out = ref(**data), model(**data)
    torch.testing.assert_close(out.logits, out_ref.logits, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out.loss, out_ref.loss, atol=1e-6, rtol=1e-6)
    if out_ref.aux_loss is not None:
        torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, atol=1e-6, rtol=1e-6)

    out_ref.loss.backward()
    out.loss.backward()
    ref_grads, grads = {n: p.grad for n, p in ref.named_parameters()}, hf_grads(model)
    assert set(grads) == hf_names  # the family's block is untouched: every other parameter keeps its HF name
    for name, g in ref_grads.items():
        if g is None:  # a parameter the loss does not reach (e.g. a router bias in a sampled branch)
            assert grads[name] is None, name
            continue
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
    assert not fssdp_hf.converted_experts(model)
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
    with pytest.raises(fssdp_hf.UnsupportedModelError, match=r"LlamaForCausalLM \(model_type 'llama'\).*experts contract"):
        fssdp_hf.convert(llama)
    # MoE families outside transformers' experts contract are refused by name.
    llama4 = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "llama4_text", vocab_size=VOCAB, hidden_size=16, intermediate_size=24, intermediate_size_mlp=24,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4))
    with pytest.raises(fssdp_hf.UnsupportedModelError, match=r"model_type 'llama4_text'"):
        fssdp_hf.convert(llama4)
    # An activation no expert variant computes: refused naming the model type and the hook.
    with pytest.raises(fssdp_hf.UnsupportedModelError, match=r"model_type 'mixtral'.*_apply_gate.*matches none"):
        fssdp_hf.convert(tiny_model("mixtral", hidden_act="relu"))
    model = fssdp_hf.convert(tiny_model("olmoe"), route_initialize=False)
    with pytest.raises(ValueError, match="already converted"):
        fssdp_hf.convert(model)


def test_partly_frozen_experts_are_refused():
    model = tiny_model("qwen3_moe")
    model.model.layers[0].mlp.experts.down_proj.requires_grad_(False)
    with pytest.raises(ValueError, match="require grad and others do not"):
        fssdp_hf.convert(model, route_initialize=False)


def test_convert_routes_deepspeed_initialize():
    import deepspeed

    from ds_fssdp.runtime.engine import _deepspeed_initialize
    try:
        fssdp_hf.convert(tiny_model("olmoe"))
        assert deepspeed.initialize is fssdp_hf.initialize
    finally:
        fssdp_hf.restore_deepspeed_initialize()
    assert deepspeed.initialize is _deepspeed_initialize

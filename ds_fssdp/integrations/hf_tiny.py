"""Tiny configs of the Hugging Face MoE families ds_fssdp is tested on (no download).

``tiny_config(model_type, hidden=16, experts=4, ffn=12, layers=2)`` builds a small config of the
family with its own routing switched on where it has one (group-limited top-k, sigmoid scores
with a selection bias, routed scaling, renormalisation, shared experts, linear attention for the
hybrid families). The tests, the HF Trainer example and ``benchmarks/hf_models.py`` use it; it is
also the quickest way to check a new family: add its keys here and run
``tests/test_hf_convert.py`` and ``tests/test_hf_families_training.py``.
"""
from __future__ import annotations


def _family_keys(hidden: int, experts: int, ffn: int) -> dict:
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2)
    mla = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=hidden // 2,
               head_dim=4, num_attention_heads=2, num_key_value_heads=2)
    linear = dict(layer_types=None, linear_conv_kernel_dim=2, linear_key_head_dim=4, linear_value_head_dim=4,
                  linear_num_key_heads=2, linear_num_value_heads=2)
    shared = 2 * ffn - 4
    local = dict(**heads, num_local_experts=experts, intermediate_size=ffn)
    grouped = dict(n_routed_experts=experts, moe_intermediate_size=ffn, n_shared_experts=1, n_group=2, topk_group=1,
                   first_k_dense_replace=0)
    return {
        "mixtral": local,
        # norm_topk_prob False (the Qwen default): raw softmax weights; a shared expert behind a sigmoid gate.
        "qwen2_moe": dict(**heads, num_experts=experts, moe_intermediate_size=ffn, shared_expert_intermediate_size=shared,
                          norm_topk_prob=False),
        "qwen3_moe": dict(**heads, num_experts=experts, moe_intermediate_size=ffn, norm_topk_prob=True),
        "olmoe": dict(**heads, num_experts=experts, intermediate_size=ffn, norm_topk_prob=False),
        # Sigmoid scores + e_score_correction_bias, group-limited top-k (2 groups, 1 kept), routed scaling.
        "deepseek_v3": dict(**mla, **grouped, routed_scaling_factor=2.5, norm_topk_prob=True),
        # Group-limited greedy top-k over softmax scores, routed scaling, shared experts.
        "deepseek_v2": dict(**mla, **grouped, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                            norm_topk_prob=False),
        "glm4_moe": dict(**heads, **grouped, routed_scaling_factor=1.5, norm_topk_prob=True),
        "qwen3_5_moe_text": dict(**heads, **linear, num_experts=experts, moe_intermediate_size=ffn,
                                 shared_expert_intermediate_size=shared),
        "qwen3_next": dict(**heads, **linear, num_experts=experts, moe_intermediate_size=ffn,
                           shared_expert_intermediate_size=shared, norm_topk_prob=True),
        # Interleaved, transposed gate/up with biases; clamped (up + 1) * gate * sigmoid(alpha * gate).
        "gpt_oss": dict(**heads, num_local_experts=experts, intermediate_size=ffn, layer_types=None, sliding_window=8),
        **dict.fromkeys(("minimax_m2", "phimoe", "granitemoe"), local),
    }


TESTED_FAMILIES = tuple(_family_keys(16, 4, 12))
_LAYER_TYPES = {"qwen3_5_moe_text": ("linear_attention", "full_attention"),
                "qwen3_next": ("linear_attention", "full_attention"),
                "gpt_oss": ("sliding_attention", "full_attention")}


def tiny_config(model_type: str, *, hidden: int = 16, experts: int = 4, ffn: int = 12, layers: int = 2, vocab: int = 64,
                top_k: int = 2, **overrides):
    """A small config of ``model_type`` (one of :data:`TESTED_FAMILIES`); special ids inside the vocab."""
    import transformers
    families = _family_keys(hidden, experts, ffn)
    if model_type not in families:
        raise ValueError(f"tiny_config: no tiny config for model_type {model_type!r}; known: {', '.join(families)}")
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, max_position_embeddings=256,
                  output_router_logits=True, router_aux_loss_coef=0.1, initializer_range=0.2, bos_token_id=2,
                  eos_token_id=1, pad_token_id=0, tie_word_embeddings=False, intermediate_size=2 * ffn,
                  num_experts_per_tok=top_k)
    kwargs.update(families[model_type])
    if model_type in _LAYER_TYPES:
        pattern = _LAYER_TYPES[model_type]
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    kwargs.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **kwargs)

"""Adapters that put existing models on FSSDP.

* :mod:`ds_fssdp.integrations.hf`: convert a Hugging Face ``transformers`` MoE model (Mixtral,
  Qwen2-MoE, Qwen3-MoE, OLMoE) in place, and train it with the HF Trainer.
* :mod:`ds_fssdp.integrations.deepspeed_moe`: ``MoE``, a drop-in for ``deepspeed.moe.layer.MoE``
  (exported as ``ds_fssdp.MoE``).

Submodules are imported on use: ``transformers`` is only needed by ``hf``.
"""
